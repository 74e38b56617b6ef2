"""quantized_layers keys vs vLLM 0.33.0's modelopt_mixed resolution (tests/export/vllm_resolution.py).

For every MoE family the project targets (laguna, qwen3_moe, deepseek_v3, glm4_moe, kimi_k25, mixtral,
minimax_m2): the keys ModelOpt 0.47 writes for a MIXED_PRECISION export (module names of the fused
experts, ``model.layers.L.mlp.experts``, reverted to hub names by ``build_reverse_name_mapper`` --
``block_sparse_moe`` for Mixtral and MiniMax-M2, unreverted in-memory names for Kimi-K2.5 whose reverse
conversion ModelOpt cannot do) must resolve, under vLLM's own code, to the routed-experts module of
each quantized layer, BF16 layers to nothing, and no key may go unread.

Findings pinned here: MiniMax-M2's ModelOpt keys resolve to nothing in vLLM 0.33 (its MoE block is the
attribute ``block_sparse_moe`` but passes the prefix ``.mlp`` to its experts); Mixtral needs the
reverted ``block_sparse_moe`` names; any key under ``...mlp.`` (e.g. a quantized shared expert)
quantizes the routed experts of that layer (the ``.experts`` parent fallback); an entry's
``weight_scale_encoding`` is neither checked nor used (vLLM 0.34.0 checked it and decoded CSF scales).

The synthetic tests need neither vLLM nor ModelOpt; the ModelOpt-backed tests (real keys from ModelOpt
0.47's export code, and this repo's Laguna export config) import ModelOpt once per module.
"""

from __future__ import annotations

import copy
import json
import os
import re
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from vllm_resolution import (
    MODEL_TYPES,
    NotMixedPrecision,
    load_hf_config,
    resolve,
    resolve_quantized_layers,
    routed_expert_prefixes,
    unmatched_quantized_layers,
)

NVFP4 = {"quant_algo": "W4A16_NVFP4", "group_size": 16}
FP8 = {"quant_algo": "FP8"}
PRODUCER = {"name": "modelopt", "version": "0.47.0"}
NUM_LAYERS = 4
SMALL = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 64,
    "moe_intermediate_size": 32,
    "num_hidden_layers": NUM_LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 16,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}
DEEPSEEK = {
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
}
MLA = {"q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16}


@dataclass(frozen=True)
class Family:
    """A small config of one model type, its MoE layers, and the two names of its routed experts."""

    config: dict
    moe_layers: tuple[int, ...]
    vllm: str  # vLLM 0.33's RoutedExperts prefix, "{}" = layer
    modelopt: str  # the quantized_layers key ModelOpt 0.47 writes

    @property
    def model_type(self) -> str:
        return self.config["model_type"]

    def placement(self) -> dict[int, dict]:
        """First MoE layer NVFP4 (W4A16), second FP8, the rest BF16 (absent from quantized_layers)."""
        return {self.moe_layers[0]: NVFP4, self.moe_layers[1]: FP8}

    def expected(self) -> dict[str, str | None]:
        placement = self.placement()
        return {
            self.vllm.format(i): placement[i]["quant_algo"] if i in placement else None
            for i in self.moe_layers
        }


FAMILIES = {
    "laguna": Family(
        {
            "model_type": "laguna",
            "architectures": ["LagunaForCausalLM"],
            **SMALL,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "shared_expert_intermediate_size": 32,
            "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
        },
        (1, 2, 3),
        "model.layers.{}.mlp.experts",
        "model.layers.{}.mlp.experts",
    ),
    "qwen3_moe": Family(
        {
            "model_type": "qwen3_moe",
            "architectures": ["Qwen3MoeForCausalLM"],
            **SMALL,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "mlp_only_layers": [1],
        },
        (0, 2, 3),
        "model.layers.{}.mlp.experts",
        "model.layers.{}.mlp.experts",
    ),
    "deepseek_v3": Family(
        {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], **SMALL, **DEEPSEEK, **MLA},
        (1, 2, 3),
        "model.layers.{}.mlp.experts",
        "model.layers.{}.mlp.experts",
    ),
    "glm4_moe": Family(
        {"model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"], **SMALL, **DEEPSEEK},
        (1, 2, 3),
        "model.layers.{}.mlp.experts",
        "model.layers.{}.mlp.experts",
    ),
    "kimi_k25": Family(
        {
            "model_type": "kimi_k25",
            "architectures": ["KimiK25ForConditionalGeneration"],
            "text_config": {"model_type": "deepseek_v3", **SMALL, **DEEPSEEK, **MLA},
            "vision_config": {
                "hidden_size": 32,
                "intermediate_size": 32,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
            },
            "projection_hidden_size": 32,
        },
        (1, 2, 3),
        "language_model.model.layers.{}.mlp.experts",
        "model.language_model.layers.{}.mlp.experts",
    ),
    "mixtral": Family(
        {
            "model_type": "mixtral",
            "architectures": ["MixtralForCausalLM"],
            **SMALL,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
        },
        (0, 1, 2, 3),
        "model.layers.{}.block_sparse_moe.experts",
        "model.layers.{}.block_sparse_moe.experts",
    ),
    "minimax_m2": Family(
        {
            "model_type": "minimax_m2",
            "architectures": ["MiniMaxM2ForCausalLM"],
            **SMALL,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "rotary_dim": 8,
        },
        (0, 1, 2, 3),
        "model.layers.{}.mlp.experts",
        "model.layers.{}.block_sparse_moe.experts",
    ),
}
assert set(FAMILIES) == set(MODEL_TYPES)
RESOLVING = [name for name, f in FAMILIES.items() if name != "minimax_m2"]


def hf_quant_config(quantized_layers: dict[str, dict]) -> dict:
    """hf_quant_config.json of a ModelOpt MIXED_PRECISION export (quant_utils.process_layer_quant_config)."""
    return {
        "producer": PRODUCER,
        "quantization": {
            "quant_algo": "MIXED_PRECISION",
            "kv_cache_quant_algo": None,
            "quantized_layers": copy.deepcopy(quantized_layers),
        },
    }


def quantization_config(hf: dict) -> dict:
    """config.json's quantization_config, the fields of ModelOpt's convert_hf_quant_config_format that
    vLLM reads (convert_hf_config.py: quantized_layers copied, ignore = exclude_modules or [])."""
    q = hf["quantization"]
    return {
        "producer": hf["producer"],
        "quant_method": "modelopt",
        "quantized_layers": copy.deepcopy(q["quantized_layers"]),
        "ignore": q.get("exclude_modules") or [],
        "quant_algo": q["quant_algo"],
    }


def write_export(
    directory: Path,
    config: dict,
    quantized_layers: dict | None = None,
    *,
    hf: dict | None = None,
    embedded: dict | None | str = "same",
) -> Path:
    """config.json (+ ``quantization_config``) and hf_quant_config.json, as a ModelOpt export has them."""
    directory.mkdir(parents=True, exist_ok=True)
    hf = hf if hf is not None else hf_quant_config(quantized_layers)
    config = dict(config)
    if embedded == "same":
        embedded = quantization_config(hf)
    if embedded is not None:
        config["quantization_config"] = embedded
    (directory / "config.json").write_text(json.dumps(config, indent=4))
    (directory / "hf_quant_config.json").write_text(json.dumps(hf, indent=4))
    return directory


def family_export(tmp_path: Path, family: Family, key: str | None = None) -> Path:
    key = key or family.modelopt
    layers = {key.format(i): info for i, info in family.placement().items()}
    return write_export(tmp_path / family.model_type, family.config, layers)


@pytest.fixture(scope="module")
def hf_configs(tmp_path_factory) -> dict:
    """transformers configs of the families (read as vLLM reads them), built once."""
    out = {}
    for name, family in FAMILIES.items():
        directory = tmp_path_factory.mktemp(name)
        (directory / "config.json").write_text(json.dumps(family.config))
        out[name] = load_hf_config(directory)
    return out


# ------------------------------------------------------------------------------ synthetic exports


@pytest.mark.parametrize("name", FAMILIES)
def test_routed_expert_prefixes(name, hf_configs):
    family = FAMILIES[name]
    prefixes = routed_expert_prefixes(hf_configs[name])
    assert prefixes == {i: family.vllm.format(i) for i in family.moe_layers}


@pytest.mark.parametrize("name", RESOLVING)
def test_modelopt_keys_resolve_to_the_routed_experts(name, hf_configs, tmp_path):
    """Each quantized MoE layer -> its algo and method, BF16 layers -> None, every key read."""
    family = FAMILIES[name]
    result = resolve(family_export(tmp_path, family), name, hf_configs[name])
    assert result.source == "config.json"
    assert result.by_prefix == family.expected()
    assert result.unmatched == ()
    methods = {e.layer: e.method for e in result.experts}
    first, second, *rest = family.moe_layers
    assert methods == {first: "ModelOptNvFp4FusedMoE", second: "ModelOptFp8MoEMethod", **dict.fromkeys(rest)}
    keys = {e.layer: e.keys for e in result.experts}
    assert keys[first] == (family.modelopt.format(first),)
    assert keys[second] == (family.modelopt.format(second),)
    assert all(keys[i] == () for i in rest)


def test_minimax_m2_modelopt_keys_resolve_nothing(hf_configs, tmp_path):
    """vLLM 0.33 asks for ``model.layers.L.mlp.experts`` (minimax_m2.py:285-289 passes ``.mlp``), ModelOpt
    writes the hub name ``model.layers.L.block_sparse_moe.experts``: every expert would load as BF16."""
    family = FAMILIES["minimax_m2"]
    result = resolve(family_export(tmp_path, family), "minimax_m2", hf_configs["minimax_m2"])
    assert result.by_prefix == dict.fromkeys(family.expected())
    assert sorted(result.unmatched) == sorted(family.modelopt.format(i) for i in family.placement())
    # The in-memory name (what ModelOpt writes when its reverse renaming is skipped) is what vLLM reads.
    fixed = resolve(
        family_export(tmp_path / "mlp", family, family.vllm), "minimax_m2", hf_configs["minimax_m2"]
    )
    assert fixed.by_prefix == family.expected() and fixed.unmatched == ()


def test_mixtral_needs_the_hub_names(hf_configs, tmp_path):
    """ModelOpt's unreverted in-memory name ``model.layers.L.mlp.experts`` is not a vLLM Mixtral module."""
    family = FAMILIES["mixtral"]
    result = resolve(
        family_export(tmp_path, family, "model.layers.{}.mlp.experts"), "mixtral", hf_configs["mixtral"]
    )
    assert result.by_prefix == dict.fromkeys(family.expected())
    assert len(result.unmatched) == len(family.placement())


@pytest.mark.parametrize(
    "spelling",
    [
        "model.language_model.layers.{}.mlp.experts",  # transformers 5 in-memory (ModelOpt 0.47)
        "language_model.model.layers.{}.mlp.experts",  # vLLM's own module name
        "language_model.layers.{}.mlp.experts",  # legacy NVFP4 name, renamed by the model's mapper
    ],
)
def test_kimi_k25_spellings(spelling, hf_configs, tmp_path):
    family = FAMILIES["kimi_k25"]
    result = resolve(family_export(tmp_path, family, spelling), "kimi_k25", hf_configs["kimi_k25"])
    assert result.by_prefix == family.expected()
    assert result.unmatched == ()


def test_misspelled_key_resolves_nothing_and_is_reported(tmp_path):
    family = FAMILIES["laguna"]
    layers = {"model.layers.1.moe.experts": NVFP4, "model.layers.2.mlp.experts": FP8}
    export = write_export(tmp_path, family.config, layers)
    assert resolve_quantized_layers(export, "laguna") == {
        "model.layers.1.mlp.experts": None,
        "model.layers.2.mlp.experts": "FP8",
        "model.layers.3.mlp.experts": None,
    }
    assert unmatched_quantized_layers(export, "laguna") == ["model.layers.1.moe.experts"]


def test_any_key_under_the_moe_block_quantizes_its_routed_experts(hf_configs, tmp_path):
    """``_resolve_quant_algo``'s ``.experts`` parent fallback: a quantized shared expert (or a near miss
    such as ``mlp.expert``) decides the routed experts of its layer."""
    family = FAMILIES["laguna"]
    layers = {"model.layers.1.mlp.shared_expert": FP8, "model.layers.2.mlp.expert": NVFP4}
    result = resolve(write_export(tmp_path, family.config, layers), "laguna", hf_configs["laguna"])
    assert result.by_prefix == {
        "model.layers.1.mlp.experts": "FP8",
        "model.layers.2.mlp.experts": "W4A16_NVFP4",
        "model.layers.3.mlp.experts": None,
    }
    assert result.unmatched == ()


def test_weight_scale_encoding_is_not_checked(hf_configs, tmp_path):
    """vLLM 0.33.0 reads no ``weight_scale_encoding`` of a ``quantized_layers`` entry: it accepts any value,
    on any algo, and resolves the entry as if it were absent. (vLLM 0.34.0 rejected all but a CSF encoding
    of an NVFP4 entry, modelopt.py:1706-1713, and decoded CSF scales on load; 0.33.0 has no CSF support, so
    an export must not write CSF-encoded scales for it.)"""
    family = FAMILIES["laguna"]
    layers = {
        "model.layers.1.mlp.experts": {**NVFP4, "weight_scale_encoding": "csf"},
        "model.layers.2.mlp.experts": {**FP8, "weight_scale_encoding": "no-such-encoding"},
    }
    result = resolve(write_export(tmp_path, family.config, layers), "laguna", hf_configs["laguna"])
    assert result.by_prefix == {
        "model.layers.1.mlp.experts": "W4A16_NVFP4",
        "model.layers.2.mlp.experts": "FP8",
        "model.layers.3.mlp.experts": None,
    }
    assert [e.method for e in result.experts] == ["ModelOptNvFp4FusedMoE", "ModelOptFp8MoEMethod", None]
    assert result.unmatched == ()


def test_which_file_vllm_reads(hf_configs, tmp_path):
    """config.json's quantization_config wins; hf_quant_config.json when it has no quantized_layers or
    when config.json has no quantization_config (transformers_utils/config.py, weight_utils.py)."""
    family, hf_config = FAMILIES["laguna"], hf_configs["laguna"]
    in_file = hf_quant_config({"model.layers.1.mlp.experts": FP8})
    embedded = quantization_config(hf_quant_config({"model.layers.2.mlp.experts": NVFP4}))
    both = resolve(
        write_export(tmp_path / "a", family.config, hf=in_file, embedded=embedded), "laguna", hf_config
    )
    assert both.source == "config.json"
    assert both.by_prefix["model.layers.2.mlp.experts"] == "W4A16_NVFP4"
    assert both.by_prefix["model.layers.1.mlp.experts"] is None
    legacy = {k: v for k, v in embedded.items() if k != "quantized_layers"}
    old = resolve(
        write_export(tmp_path / "b", family.config, hf=in_file, embedded=legacy), "laguna", hf_config
    )
    assert old.source == "hf_quant_config.json" and old.by_prefix["model.layers.1.mlp.experts"] == "FP8"
    bare = resolve(
        write_export(tmp_path / "c", family.config, hf=in_file, embedded=None), "laguna", hf_config
    )
    assert bare.source == "hf_quant_config.json" and bare.by_prefix["model.layers.1.mlp.experts"] == "FP8"


def test_hf_quant_config_json_alone_needs_the_modelopt_producer(tmp_path):
    """vLLM tags ``quant_method`` only for ``producer.name == "modelopt"`` (model_arch_config_convertor.py:
    248-269) and reads a fallback hf_quant_config.json only with that producer (weight_utils.py:391-397):
    an export that renames the producer must embed quantized_layers in config.json (ModelOpt 0.47's
    convert_hf_quant_config_format does, with ``quant_method: modelopt``)."""
    family = FAMILIES["laguna"]
    ours = {**hf_quant_config({"model.layers.1.mlp.experts": FP8}), "producer": {"name": "mixquant"}}
    with pytest.raises(NotMixedPrecision, match="quant_method ''"):
        resolve(write_export(tmp_path / "a", family.config, hf=ours, embedded=None), "laguna")
    legacy = {k: v for k, v in quantization_config(ours).items() if k != "quantized_layers"}
    with pytest.raises(ValueError, match="Unsupported quantization config"):
        resolve(write_export(tmp_path / "b", family.config, hf=ours, embedded=legacy), "laguna")
    embedded = resolve(write_export(tmp_path / "c", family.config, hf=ours), "laguna")
    assert embedded.by_prefix["model.layers.1.mlp.experts"] == "FP8" and embedded.unmatched == ()


def test_single_format_export_is_not_modelopt_mixed(tmp_path):
    family = FAMILIES["laguna"]
    hf = {"producer": PRODUCER, "quantization": {"quant_algo": "W4A16_NVFP4", "group_size": 16}}
    embedded = {"producer": PRODUCER, "quant_method": "modelopt", "quant_algo": "W4A16_NVFP4", "ignore": []}
    with pytest.raises(NotMixedPrecision, match="W4A16_NVFP4"):
        resolve(write_export(tmp_path / "a", family.config, hf=hf, embedded=embedded), "laguna")
    # vLLM's normaliser knows no W4A16_NVFP4 in a bare hf_quant_config.json (model_arch_config_convertor.py).
    with pytest.raises(ValueError, match="Unknown ModelOpt quant algo: W4A16_NVFP4"):
        resolve(write_export(tmp_path / "b", family.config, hf=hf, embedded=None), "laguna")


def test_model_type_must_match_config(tmp_path):
    export = family_export(tmp_path, FAMILIES["laguna"])
    with pytest.raises(ValueError, match="model_type"):
        resolve(export, "qwen3_moe")


@pytest.mark.parametrize(
    ("extra", "moe_layers"),
    [({}, (0, 1, 2, 3)), ({"decoder_sparse_step": 2}, (1, 3)), ({"mlp_only_layers": [0, 3]}, (1, 2))],
)
def test_qwen3_moe_layer_rule_with_transformers_defaults(extra, moe_layers, tmp_path):
    """config.json written by save_pretrained omits defaults (decoder_sparse_step=1, mlp_only_layers=[])."""
    config = {k: v for k, v in FAMILIES["qwen3_moe"].config.items() if k != "mlp_only_layers"}
    (tmp_path / "config.json").write_text(json.dumps({**config, **extra}))
    assert tuple(routed_expert_prefixes(load_hf_config(tmp_path))) == moe_layers


# -------------------------------------------------------------------- ModelOpt 0.47's own keys


@pytest.fixture(scope="module")
def modelopt():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import modelopt.torch.opt as mto
        from modelopt.torch.export.quant_aware_conversion import (
            build_reverse_name_mapper,
            revert_quant_config_names,
        )
        from modelopt.torch.export.quant_utils import get_quant_config
    return mto, build_reverse_name_mapper, revert_quant_config_names, get_quant_config


# ModelOpt quantizer configs: NVFP4 weights with no input quantizer export as W4A16_NVFP4, E4M3 per-tensor
# weight + input as FP8 (quant_utils.get_quantization_format / process_layer_quant_config).
_NVFP4_WEIGHT = {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}}
_FP8 = {"num_bits": (4, 3), "axis": None}


def modelopt_quantized_layers(modelopt, hf_config, placement: dict[int, dict]) -> dict:
    """``quantized_layers`` as ModelOpt 0.47's ``export_hf_checkpoint`` writes them, without weights.

    Meta-device model, quantize mode with the placement (routed experts of the given layers only),
    ``get_quant_config`` (before the experts are unfused, unified_export_hf.py) and the quant-aware
    reverse renaming of module names, skipped (in-memory names kept) when ModelOpt cannot reverse the
    model's conversion -- the try/except of unified_export_hf.py's export path.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    mto, build_reverse_name_mapper, revert_quant_config_names, get_quant_config = modelopt
    entries = [{"quantizer_name": "*", "enable": False}]
    for layer, info in placement.items():
        stem = f"*layers.{layer}.mlp.experts.*"
        if info == NVFP4:
            entries.append({"quantizer_name": stem + "weight_quantizer", "cfg": _NVFP4_WEIGHT})
        else:
            entries.append({"quantizer_name": stem + "weight_quantizer", "cfg": _FP8})
            entries.append({"quantizer_name": stem + "input_quantizer", "cfg": _FP8})
    auto = AutoModelForImageTextToText if hf_config.model_type == "kimi_k25" else AutoModelForCausalLM
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.device("meta"):
            model = auto.from_config(hf_config)
        model = mto.apply_mode(model, mode=[("quantize", {"quant_cfg": entries, "algorithm": "max"})])
        quantization = get_quant_config(model)["quantization"]
        try:
            mapper = build_reverse_name_mapper(model)
            if mapper is not None:
                revert_quant_config_names(quantization, mapper)
        except Exception:
            pass
    assert quantization["quant_algo"] == "MIXED_PRECISION"
    return quantization["quantized_layers"]


@pytest.mark.parametrize("name", FAMILIES)
def test_modelopt_writes_the_keys_assumed_here(name, modelopt, hf_configs, tmp_path):
    """The synthetic keys above are ModelOpt's; run them through vLLM's resolution again from the source."""
    family = FAMILIES[name]
    layers = modelopt_quantized_layers(modelopt, hf_configs[name], family.placement())
    assert layers == {family.modelopt.format(i): info for i, info in family.placement().items()}
    result = resolve(write_export(tmp_path, family.config, layers), name, hf_configs[name])
    if name == "minimax_m2":
        assert set(result.by_prefix.values()) == {None}
    else:
        assert result.by_prefix == family.expected() and result.unmatched == ()


def test_repo_laguna_export_config_resolves(modelopt, small_laguna_config, tmp_path):
    """The configs mixquant.export.checkpoint writes (ModelOpt's code, producer replaced) for a Laguna."""
    from mixquant.export.modelopt_config import modelopt_hf_quant_config, modelopt_quantization_config
    from mixquant.quantize.reference import BF16, FP8, NVFP4

    config = {**small_laguna_config().to_dict(), "architectures": ["LagunaForCausalLM"]}
    placement = {1: NVFP4, 2: FP8, 3: BF16, 4: NVFP4}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = modelopt_hf_quant_config(config, placement, producer={"name": "mixquant"})
    export = write_export(tmp_path, config, hf=hf, embedded=modelopt_quantization_config(hf))
    result = resolve(export, "laguna")
    assert result.by_prefix == {
        "model.layers.1.mlp.experts": "W4A16_NVFP4",
        "model.layers.2.mlp.experts": "FP8",
        "model.layers.3.mlp.experts": None,
        "model.layers.4.mlp.experts": "W4A16_NVFP4",
    }
    assert result.unmatched == ()
    assert result.architecture == "LagunaForCausalLM"


# ---------------------------------------------------------------------------- vendored excerpts

WHEEL = Path(
    os.environ.get("VLLM_033_WHEEL", "/tmp/vllm-wheel/vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl")
)
_BEGIN = re.compile(r"^\s*# >>> vllm 0\.33\.0 (\S+):(\d+)-(\d+)$")


@pytest.mark.skipif(not WHEEL.exists(), reason=f"vLLM 0.33.0 wheel not at {WHEEL} (set VLLM_033_WHEEL)")
def test_vendored_excerpts_are_verbatim():
    """Every ``# >>> vllm 0.33.0 file:a-b`` block equals lines a..b of the wheel's file (imports aside)."""
    blocks = 0
    with zipfile.ZipFile(WHEEL) as wheel:
        for path in sorted((Path(__file__).parent / "vllm_033").glob("*.py")):
            lines = path.read_text(encoding="utf-8").splitlines()
            for n, line in enumerate(lines):
                match = _BEGIN.match(line)
                if not match:
                    continue
                source, first, last = match.group(1), int(match.group(2)), int(match.group(3))
                original = wheel.read(source).decode("utf-8").splitlines()[first - 1 : last]
                copied = lines[n + 1 : n + 1 + len(original)]
                end = lines[n + 1 + len(original)].strip()
                assert end == f"# <<< vllm 0.33.0 {source}:{first}-{last}", path
                for want, got in zip(original, copied, strict=True):
                    if got.endswith("# replaced import"):
                        assert want.lstrip().startswith(("from ", "import ")), (path, want)
                    else:
                        assert got == want, (path.name, source, want, got)
                blocks += 1
    assert blocks >= 30
