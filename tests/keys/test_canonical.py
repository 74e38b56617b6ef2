import hashlib
import math

import pytest
from mixquant.keys.canonical import CanonicalError, canonical_json, canonical_sha256


def test_golden_mixed_int_and_str_keys():
    # A ModelOpt NVFP4 quantizer config: int block-size keys next to str keys.
    config = {
        "num_bits": (2, 1),
        "block_sizes": {-1: 16, "type": "static", "scale_bits": (4, 3)},
        "enable": True,
    }
    text = canonical_json(config)
    assert text == (
        '{"block_sizes":{"$map":[["scale_bits",[4,3]],["type","static"],[-1,16]]},'
        '"enable":true,"num_bits":[2,1]}'
    )
    assert canonical_sha256(config) == hashlib.sha256(text.encode()).hexdigest()


def test_golden_key_value():
    preimage = {
        "key_schema": 1,
        "stage": "sample_calibration",
        "config": {"num_samples": 64, "seq_len": 256, "scale": 0.1, "pair": (1, "a")},
        "upstream": {"model": "0" * 64},
    }
    assert canonical_json(preimage) == (
        '{"config":{"num_samples":64,"pair":[1,"a"],"scale":0.1,"seq_len":256},"key_schema":1,'
        '"stage":"sample_calibration","upstream":{"model":"' + "0" * 64 + '"}}'
    )
    assert canonical_sha256(preimage) == hashlib.sha256(canonical_json(preimage).encode()).hexdigest()


def test_dict_order_does_not_matter_but_key_types_do():
    assert canonical_sha256({"a": 1, "b": 2}) == canonical_sha256({"b": 2, "a": 1})
    assert canonical_sha256({1: "x", "y": 2}) == canonical_sha256({"y": 2, 1: "x"})
    assert canonical_sha256({1: "x"}) != canonical_sha256({"1": "x"})
    assert canonical_sha256({True: "x"}) != canonical_sha256({1: "x"})


def test_tuples_equal_lists_and_floats_round_trip():
    assert canonical_json((1, 2.5, "a")) == canonical_json([1, 2.5, "a"])
    assert canonical_json(0.1) == "0.1"
    assert canonical_json(1e-300) == "1e-300"
    assert canonical_json(1.0) != canonical_json(1)
    assert canonical_json(True) != canonical_json(1)


def test_numpy_and_torch_scalars_are_plain_numbers():
    numpy = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    assert canonical_json({"a": numpy.int64(3), "b": numpy.float32(0.5)}) == '{"a":3,"b":0.5}'
    assert canonical_json(torch.tensor(7)) == "7"


@pytest.mark.parametrize("bad", [math.nan, math.inf, {1, 2}, object(), {"$map": 1}])
def test_values_without_canonical_form_are_refused(bad):
    with pytest.raises(CanonicalError):
        canonical_json({"x": bad})
