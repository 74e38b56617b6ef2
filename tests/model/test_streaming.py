"""Layer streaming (mixquant.model.streaming) and the branch-parallel scorer (mixquant.search.branches):
bit-identical to the whole-model forward and the per-layer suffix scorer, layers read into their fused
parameters exactly as transformers' conversion builds them (every family), each layer read once per pass,
bytes read as the cost model says, bounded resident memory, and a killed scoring pass that resumes."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mixquant.checkpoint.shards import CheckpointError, ShardReader
from mixquant.model.streaming import StreamedModel
from mixquant.search.branches import PROGRESS_FILE, branch_parallel_scores
from mixquant.search.score import LayerQuant, load_search_model, scores_table, sensitivity_scores
from streaming_helpers import laguna_config, score, write_random_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "families"))
from family_models import SPECS, make_instance  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
HELPERS = Path(__file__).with_name("streaming_helpers.py")
TOY = REPO / "data" / "toy-laguna"


@pytest.fixture(scope="module")
def laguna4(tmp_path_factory) -> Path:
    """A 4-layer Laguna-shaped random checkpoint: dense layer 0, MoE layers 1-3 (16 experts, shared
    expert, sigmoid router with correction bias), full and sliding attention."""
    return write_random_checkpoint(laguna_config(num_hidden_layers=4), tmp_path_factory.mktemp("laguna4"))


@pytest.fixture(params=["toy", "laguna4"])
def checkpoint(request, laguna4) -> Path:
    return TOY if request.param == "toy" else laguna4


def _ids(model_dir: Path, sequences: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    return torch.randint(0, vocab, (sequences, seq_len), generator=torch.Generator().manual_seed(seed))


def _moe_layers(model_dir: Path) -> list[int]:
    types = json.loads((model_dir / "config.json").read_text())["mlp_layer_types"]
    return [i for i, kind in enumerate(types) if kind == "sparse"]


def test_streamed_forward_equals_the_whole_model(checkpoint):
    ids = _ids(checkpoint, 4, 48)
    model = load_search_model(checkpoint)
    with torch.inference_mode():
        want = [model(input_ids=ids[i : i + 2], use_cache=False).logits for i in (0, 2)]
    with StreamedModel(checkpoint) as stream:
        got = stream.forward([ids[0:2], ids[2:4]])
        assert dict(stream.reader.reads) == dict.fromkeys(range(stream.num_layers), 1)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


class RecordingReader(ShardReader):
    """A reader that records which tensors were read straight into a caller's buffer (``into``)."""

    def __init__(self, model_dir: Path):
        super().__init__(model_dir)
        self.read_in_place: set[str] = set()

    def read(self, names, **kwargs):
        self.read_in_place.update(kwargs.get("into") or {})
        return super().read(names, **kwargs)


@pytest.fixture(scope="module")
def export(laguna4, tmp_path_factory) -> Path:
    """A ModelOpt export of ``laguna4``: NVFP4 W4A16, FP8 and BF16 MoE layers (the dequantizing path)."""
    from mixquant.quantize.reference import modelopt_reference_export

    out = tmp_path_factory.mktemp("export")
    ids = _ids(laguna4, 4, 12, seed=2)
    modelopt_reference_export(laguna4, ids, {1: "nvfp4_w4a16", 2: "fp8", 3: "bf16"}, out, batch_size=2)
    return out


LOAD_CASES = ["toy", "laguna4", "laguna4-as-float32", "export-dequantized", *SPECS]


@pytest.fixture(params=LOAD_CASES)
def load_case(request, laguna4, tmp_path_factory) -> tuple[Path, dict]:
    """A checkpoint and the StreamedModel settings it streams with: the toy, the Laguna test checkpoint (also
    loaded as float32: the fused parameter is cast like any tensor), a ModelOpt export dequantized as it is
    read, and a small instance of every other family's class in its upstream layout."""
    if request.param == "toy":
        return TOY, {}
    if request.param == "laguna4":
        return laguna4, {}
    if request.param == "laguna4-as-float32":
        return laguna4, {"dtype": torch.float32}
    if request.param == "export-dequantized":
        return request.getfixturevalue("export"), {"dequantize": True}
    return make_instance(request.param, tmp_path_factory.mktemp(request.param)), {}


def _loaded_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers of ``module`` that are loaded (a streamed model's other layers are on meta)."""
    named = [*module.named_parameters(), *module.named_buffers()]
    return {name: tensor for name, tensor in named if tensor.device.type != "meta"}


def _layout(tensor: torch.Tensor) -> tuple:
    return type(tensor), tensor.dtype, tensor.shape, tensor.stride(), tensor.device, tensor.requires_grad


def _assert_same_tensors(want: torch.nn.Module, got: torch.nn.Module, what: str) -> None:
    """Every loaded parameter and buffer: the same names, types, dtypes, shapes, strides, devices, values."""
    want_all, got_all = _loaded_tensors(want), _loaded_tensors(got)
    assert want_all
    assert sorted(got_all) == sorted(want_all), what
    for name, tensor in want_all.items():
        assert _layout(got_all[name]) == _layout(tensor), f"{what}: {name}"
        assert torch.equal(got_all[name], tensor), f"{what}: {name}"


def _assert_fused_reads_exact(model_dir: Path, settings: dict) -> None:
    """Every layer streamed with fused reads (prefetching) against the same layer loaded by transformers'
    conversion alone; every routed-expert tensor of an upstream checkpoint read straight into place."""
    reader = RecordingReader(model_dir)
    with (
        StreamedModel(model_dir, fused_reads=False, prefetch=False, **settings) as reference,
        StreamedModel(model_dir, reader=reader, **settings) as fused,
    ):
        _assert_same_tensors(reference.model, fused.model, "embeddings, final norm, lm_head")
        for i, layer in fused.stream():
            _assert_same_tensors(reference.load_layer(i), layer, f"layer {i}")
            reference.release_layer(i)
        assert dict(reader.reads) == dict.fromkeys(range(fused.num_layers), 1)
    experts = {name for name in reader.names if re.search(r"\.experts\.\d+\.", name)}
    assert experts
    assert reader.read_in_place == (set() if settings.get("dequantize") else experts)


def test_fused_reads_build_exactly_what_transformers_conversion_builds(load_case):
    """Every parameter of every layer (and of the embeddings and head), loaded with fused reads and
    prefetching, is bit for bit what transformers' own conversion builds from the per-expert tensors."""
    _assert_fused_reads_exact(*load_case)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", ["laguna4", "export-dequantized"])
def test_fused_reads_on_cuda_build_what_transformers_conversion_builds(case, request):
    """The same on CUDA: pinned fused buffers, copied to the device by transformers' loader."""
    model_dir = request.getfixturevalue("laguna4" if case == "laguna4" else "export")
    _assert_fused_reads_exact(model_dir, {"device": "cuda", "dequantize": case != "laguna4"})


def test_an_expert_missing_from_the_index_fails_as_transformers_does(laguna4, tmp_path):
    """A parameter the fused reads cannot build (an expert's up projection not in the index) is left to
    transformers' conversion, which reports it: the same error either way."""
    broken = tmp_path / "broken"
    shutil.copytree(laguna4, broken)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.1.mlp.experts.3.up_proj.weight"]
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    errors = []
    for fused_reads in (False, True):
        with StreamedModel(broken, fused_reads=fused_reads, prefetch=False) as stream:
            with pytest.raises(CheckpointError, match="layer 1: cannot load") as error:
                stream.load_layer(1)
            errors.append(str(error.value))
    assert errors[0] == errors[1]


def test_reads_into_given_tensors_count_as_reads(laguna4):
    """``ShardReader.read(into=...)`` fills the caller's tensors (slices of one buffer here) with the bytes a
    plain read returns, and counts the same reads, tensors and bytes; a destination of another dtype or
    shape is refused before anything is read."""
    names = ShardReader(laguna4).layer_names(1)
    plain_reader, into_reader = ShardReader(laguna4), ShardReader(laguna4)
    plain = plain_reader.read(names)
    up = [name for name in names if name.endswith("up_proj.weight") and ".experts." in name]
    buffer = torch.empty((len(up), *plain[up[0]].shape), dtype=plain[up[0]].dtype)
    into = {name: buffer[i] for i, name in enumerate(up)}
    got = into_reader.read(names, into=into)
    assert all(got[name] is into[name] for name in up)
    assert all(torch.equal(got[name], plain[name]) for name in names)
    assert torch.equal(buffer, torch.stack([plain[name] for name in up]))
    counters = [(r.reads, r.bytes_read, r.tensors_read) for r in (plain_reader, into_reader)]
    assert counters[0] == counters[1]
    with pytest.raises(ValueError, match="cannot read BF16"):
        into_reader.read(names, into={up[0]: buffer[0].float()})
    assert (into_reader.reads, into_reader.bytes_read) == counters[0][:2]


def _quants(model_dir: Path) -> dict[str, dict[int, LayerQuant]]:
    """Every MoE layer in NVFP4 (max calibration) and FP8 (max, a fixed input amax), as quantize_layer
    writes them: the scorer's inputs."""
    from mixquant.quantize.layer import quantize_layer
    from mixquant.search.score import layer_quant_from_tensors

    out: dict[str, dict[int, LayerQuant]] = {"nvfp4_w4a16": {}, "fp8": {}}
    amax = {"gate_up": torch.tensor(6.0), "down": torch.tensor(1.5)}
    for layer in _moe_layers(model_dir):
        nvfp4, _ = quantize_layer(model_dir, layer, "nvfp4_w4a16", {"calibration": "max"})
        fp8, _ = quantize_layer(model_dir, layer, "fp8", {"weight_calibration": "max"}, activation_amax=amax)
        out["nvfp4_w4a16"][layer] = layer_quant_from_tensors(nvfp4, layer, "nvfp4_w4a16")
        out["fp8"][layer] = layer_quant_from_tensors(fp8, layer, "fp8")
    return out


def _pass_results(model_dir, ids, quants, passes, stack, batch_size=2):
    """score_sensitivity's results for ``passes`` macro-batches (a StreamedModel and reader each)."""
    results, readers = [], []
    size = ids.shape[0] // passes
    scored = {layer: ["nvfp4_w4a16", "fp8"] for layer in quants["fp8"]}
    for first in range(0, ids.shape[0], size):
        reader = ShardReader(model_dir)
        with StreamedModel(model_dir, reader=reader) as stream:
            sums = branch_parallel_scores(
                stream,
                ids[first : first + size],
                scored,
                lambda layer, fmt, loaded: quants[fmt][layer],
                batch_size=batch_size,
                stack=stack,
            )
        results.append({"sequences": [first, first + size], "sequence_length": ids.shape[1], "kl_sums": sums})
        readers.append(reader)
    return scores_table(results), readers


def test_branch_parallel_scores_equal_the_suffix_scorer_bit_for_bit(checkpoint):
    ids = _ids(checkpoint, 8, 32, seed=1)
    quants = _quants(checkpoint)
    model = load_search_model(checkpoint)
    want = {
        fmt: {
            layer: value["kl_per_token"]
            for layer, value in sensitivity_scores(model, ids, q, fmt, batch_size=2).items()
        }
        for fmt, q in quants.items()
    }
    table, readers = _pass_results(checkpoint, ids, quants, passes=2, stack=False)
    got = {fmt: {layer: table[layer][fmt] for layer in table} for fmt in want}
    assert got == want  # exact: the same floats, accumulated in the same order
    assert all(value > 0 for per_layer in got.values() for value in per_layer.values())
    # one streamed pass per macro-batch: each layer read once in each
    for reader in readers:
        assert dict(reader.reads) == dict.fromkeys(range(len(reader.reads)), 1)


def test_stacked_branches_rank_the_layers_the_same(laguna4):
    """Stacking the live branches into one batch per layer call changes GEMM shapes: not promised bit for
    bit (on this CPU path it happens to be), the ranking of the layers is."""
    ids = _ids(laguna4, 8, 32, seed=1)
    quants = _quants(laguna4)
    exact, _ = _pass_results(laguna4, ids, quants, passes=1, stack=False)
    stacked, _ = _pass_results(laguna4, ids, quants, passes=1, stack=True)
    for fmt in ("nvfp4_w4a16", "fp8"):
        order = {
            name: sorted(table, key=lambda layer: table[layer][fmt])
            for name, table in (("exact", exact), ("stacked", stacked))
        }
        assert order["exact"] == order["stacked"], fmt
        for layer in exact:
            assert stacked[layer][fmt] == pytest.approx(exact[layer][fmt], rel=1e-3)


def test_bytes_read_are_the_cost_models(laguna4):
    """A pass reads every tensor of the checkpoint exactly once: the cost model's bytes per pass."""
    from mixquant.facts import geometry_from_hf_config

    geometry = geometry_from_hf_config(json.loads((laguna4 / "config.json").read_text()))
    reader = ShardReader(laguna4)
    with StreamedModel(laguna4, reader=reader) as stream:
        stream.forward([_ids(laguna4, 2, 16)])
    assert reader.bytes_read == geometry.bf16_bytes
    assert reader.tensors_read == len(reader.names)
    ids = _ids(laguna4, 4, 16)
    from mixquant.quantize.activations import collect_activation_stats

    reader = ShardReader(laguna4)
    collect_activation_stats(laguna4, ids, batch_size=2, progress=False, reader=reader)
    assert reader.bytes_read == geometry.bf16_bytes
    assert dict(reader.reads) == dict.fromkeys(range(geometry.num_hidden_layers), 1)


def _child(*args: str, **kwargs) -> subprocess.Popen:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HELPERS.parent), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.Popen([sys.executable, str(HELPERS), *args], env=env, text=True, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["forward", "score"])
def test_resident_memory_stays_at_two_layers(tmp_path_factory, mode):
    """A checkpoint of 9 layers of ~100 MB: peak resident memory of a streamed pass (a child process,
    measured from /proc after a first pass) is at most two decoder layers plus the branch states; the
    allowance is one step's activations and the interpreter's own allocations."""
    big = tmp_path_factory.getbasetemp() / "big-checkpoint"
    if not (big / "config.json").exists():
        config = laguna_config(
            num_hidden_layers=10,
            hidden_size=256,
            intermediate_size=512,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=256,
            num_experts=128,
            vocab_size=512,
        )
        write_random_checkpoint(config, big)
    child = _child("rss", str(big), "2", "64", mode, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = child.communicate(timeout=600)
    assert child.returncode == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    layer = result["layer_bytes"]
    assert result["model_bytes"] >= 8 * layer  # the checkpoint: at least 8 times one decoder layer
    allowance = 8 << 20
    assert result["peak"] - result["base"] <= 2 * layer + result["state_bytes"] + allowance, result
    assert set(result["loads"].values()) == {2}  # two passes, each layer read once per pass


@pytest.mark.slow
def test_a_killed_scoring_pass_resumes_to_the_same_scores(laguna4, tmp_path):
    with StreamedModel(laguna4) as stream:
        clean = score(stream)
    state = tmp_path / "state"
    child = _child("kill", str(laguna4), str(state), "0.5", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    saved = 0
    while time.monotonic() < deadline and child.poll() is None:
        try:
            saved = json.loads((state / PROGRESS_FILE).read_text())["next_layer"]
        except (OSError, ValueError, KeyError):
            saved = 0
        if saved >= 2:
            break
        time.sleep(0.05)
    assert child.poll() is None, "the pass ended before it could be killed"
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    saved = json.loads((state / PROGRESS_FILE).read_text())["next_layer"]
    assert 2 <= saved < 4  # killed mid-pass, after at least two layers were saved
    reader = ShardReader(laguna4)
    with StreamedModel(laguna4, reader=reader) as stream:
        resumed = score(stream, state_dir=state, checkpoint_interval_s=0)
    assert resumed == clean
    assert sorted(reader.reads) == list(range(saved, 4))  # the saved layers were not read again


def test_a_state_saved_by_another_pass_is_ignored(laguna4, tmp_path):
    state = tmp_path / "state"
    with StreamedModel(laguna4) as stream:
        first = score(stream, state_dir=state, checkpoint_interval_s=0)
    progress = json.loads((state / PROGRESS_FILE).read_text())
    assert progress["next_layer"] == 4 and progress["state_key"] == "kill-test"
    progress["state_key"] = "another pass"
    (state / PROGRESS_FILE).write_text(json.dumps(progress))
    reader = ShardReader(laguna4)
    with StreamedModel(laguna4, reader=reader) as stream:
        assert score(stream, state_dir=state, checkpoint_interval_s=0) == first
    assert sorted(reader.reads) == [0, 1, 2, 3]  # started over
