"""Every supported MoE family on a small random instance of transformers' own class, saved in its upstream
disk layout: the architecture mixquant derives, the streamed forward and scores against the whole model,
the export against ModelOpt 0.47's own ``mtq.quantize`` + ``export_hf_checkpoint``, and the export's
quantized_layers under vLLM 0.33's resolution."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from family_models import FAMILY, SPECS, make_instance
from mixquant.model.families import UnsupportedArchitecture, architecture
from mixquant.model.instances import PUBLISHED_DTYPES
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "export"))
from vllm_resolution import resolve_quantized_layers, unmatched_quantized_layers  # noqa: E402

MODEL_TYPES = sorted(SPECS)
NVFP4, FP8, BF16 = "nvfp4_w4a16", "fp8", "bf16"
ALGOS = {NVFP4: "W4A16_NVFP4", FP8: "FP8", BF16: None}


@pytest.fixture(scope="module", params=MODEL_TYPES)
def instance(request, tmp_path_factory) -> Path:
    return make_instance(request.param, tmp_path_factory.mktemp(request.param))


def _read_all(paths) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in paths:
        with safe_open(str(path), "pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys()})  # noqa: SIM118
    return tensors


def _model_type(instance: Path) -> str:
    return json.loads((instance / "config.json").read_text())["model_type"]


def _ids(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(4, 2048, (rows, cols), generator=torch.Generator().manual_seed(seed))


def test_the_architecture_is_transformers_own(instance):
    """Names and shapes are those save_pretrained wrote; MoE layers as the config's own rule says."""
    arch = architecture(instance)
    model_type = _model_type(instance)
    assert arch.family == FAMILY[model_type]
    on_disk = {}
    for shard in instance.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as handle:
            on_disk.update({name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()})  # noqa: SIM118
    assert {name: shape for name, (shape, _) in arch.tensors.items()} == on_disk
    dense_first = model_type in ("qwen3_moe", "deepseek_v3", "glm4_moe")  # mlp_only_layers / first_k_dense
    assert arch.moe_layers == ((1, 2) if dense_first else (0, 1, 2)) and arch.num_experts == 8
    gate = arch.expert_weight(arch.moe_layers[0], 7, "gate_proj")
    assert gate in on_disk
    if arch.family == "mixtral":  # w1 / w3 / w2 under block_sparse_moe, from transformers' conversion
        assert gate.endswith("block_sparse_moe.experts.7.w1.weight")
        assert arch.expert_weight(1, 0, "up_proj").endswith(".w3.weight")
        assert arch.expert_weight(1, 0, "down_proj").endswith(".w2.weight")
    assert arch.routed_expert_of(gate.replace(".weight", ".weight_scale")) == (
        arch.moe_layers[0],
        7,
        "gate_proj",
    )


def test_the_architecture_cache_returns_what_transformers_derives(instance, tmp_path, monkeypatch):
    """A workflow start reads the derived architecture from .snakemake/mixquant-architectures: the same
    object as the derivation; a damaged entry or another transformers version derives it again."""
    import mixquant.model.families as families

    derived = architecture(instance)
    cache = tmp_path / "architectures"
    families.cache_architectures(cache)
    try:
        assert architecture(instance) == derived  # derived once more, and written
        (entry,) = cache.glob("*.json")
        families._cached_architecture.cache_clear()  # a new process: only the file is left

        def underived(config_json):
            raise AssertionError("derived although cached")

        with monkeypatch.context() as patch:
            patch.setattr(families, "_architecture", underived)
            cached = architecture(instance)
        assert cached == derived and cached.tensors == derived.tensors
        assert cached.expert_weight(cached.moe_layers[-1], 3, "down_proj") == derived.expert_weight(
            derived.moe_layers[-1], 3, "down_proj"
        )
        entry.write_text('{"config": ')  # damaged (a full disk, an editor): derived again, rewritten
        families._cached_architecture.cache_clear()
        assert architecture(instance) == derived and json.loads(entry.read_text())["config"]
        families._cached_architecture.cache_clear()
        families._derivation_identity.cache_clear()
        from importlib import metadata

        real_version = metadata.version

        def other_transformers(name):
            return "0.0" if name == "transformers" else real_version(name)

        with monkeypatch.context() as patch:
            patch.setattr(metadata, "version", other_transformers)
            assert architecture(instance) == derived
            assert len(list(cache.glob("*.json"))) == 2  # its own entry, beside the other version's
    finally:
        families.cache_architectures(None)
        families._derivation_identity.cache_clear()


def test_a_shared_architecture_cache_is_named_by_the_environment(monkeypatch, tmp_path):
    """$MIXQUANT_ARCHITECTURE_CACHE moves a workflow's cache out of its .snakemake/ (several working
    directories share it); unset or empty, each keeps its own."""
    import mixquant.model.families as families

    monkeypatch.setenv(families.CACHE_ENV, str(tmp_path / "shared"))
    assert families.workflow_cache() == tmp_path / "shared"
    monkeypatch.setenv(families.CACHE_ENV, "")
    assert families.workflow_cache() == Path(".snakemake") / "mixquant-architectures"
    monkeypatch.delenv(families.CACHE_ENV)
    assert families.workflow_cache() == families.WORKDIR_CACHE


def test_an_unsupported_type_names_itself_and_the_supported_ones():
    with pytest.raises(UnsupportedArchitecture) as error:
        architecture({"model_type": "llama"})
    assert str(error.value) == (
        "model_type 'llama' is not supported; supported: deepseek_v3, glm4_moe, laguna, minimax_m2, mixtral, "
        "qwen3_moe"
    )


def _layer_quants(instance: Path, fmt: str) -> dict:
    from mixquant.quantize.layer import quantize_layer
    from mixquant.search.score import layer_quant_from_tensors

    arch = architecture(instance)
    params = {"calibration": "max"} if fmt == NVFP4 else {"weight_calibration": "max"}
    amax = {"gate_up": torch.tensor(4.0), "down": torch.tensor(1.0)} if fmt == FP8 else None
    quants = {}
    for layer in arch.moe_layers:
        tensors, _ = quantize_layer(instance, layer, fmt, params, activation_amax=amax)
        quants[layer] = layer_quant_from_tensors(tensors, layer, fmt, arch=arch)
    return quants


def test_streamed_forward_suffix_and_branch_scores_equal_the_whole_model(instance):
    from mixquant.model.streaming import StreamedModel
    from mixquant.search.branches import branch_parallel_scores
    from mixquant.search.score import (
        _LayerInputs,
        load_search_model,
        quantized_experts,
        scores_table,
        sensitivity_scores,
        suffix_logits,
    )

    ids = _ids(4, 24)
    model = load_search_model(instance)
    with StreamedModel(instance) as stream:
        streamed = stream.forward([ids[:2], ids[2:]])
    with torch.inference_mode():
        whole = [model(input_ids=ids[i : i + 2], use_cache=False).logits for i in (0, 2)]
    assert all(torch.equal(a, b) for a, b in zip(whole, streamed, strict=True))

    quants = {NVFP4: _layer_quants(instance, NVFP4), FP8: _layer_quants(instance, FP8)}
    layer = max(quants[FP8])
    with torch.inference_mode():  # the scorer's suffix from layer L's input == a full forward, L quantized
        inputs = _LayerInputs(model, layer)
        model(input_ids=ids[:2], use_cache=False)
        inputs.remove()
        for fmt in (NVFP4, FP8):
            with quantized_experts(model, quants[fmt][layer]):
                full = model(input_ids=ids[:2], use_cache=False).logits
                assert torch.equal(suffix_logits(model, layer, inputs), full), fmt
                assert not torch.equal(full, whole[0])  # the quantization is visible in the logits

    want = {fmt: sensitivity_scores(model, ids, quants[fmt], fmt, batch_size=2) for fmt in quants}
    with StreamedModel(instance) as stream:
        sums = branch_parallel_scores(
            stream,
            ids,
            {layer: [NVFP4, FP8] for layer in quants[NVFP4]},
            lambda layer, fmt, loaded: quants[fmt][layer],
            batch_size=2,
        )
    table = scores_table([{"sequences": [0, 4], "sequence_length": 24, "kl_sums": sums}])
    for fmt, per_layer in want.items():
        assert {layer: table[layer][fmt] for layer in per_layer} == {
            layer: value["kl_per_token"] for layer, value in per_layer.items()
        }, fmt
        assert all(value["kl_per_token"] > 0 for value in per_layer.values())


@pytest.mark.slow
def test_export_equals_modelopts_own_and_vllm_resolves_it(instance, tmp_path):
    """A placement mixing the formats, rebuilt layer by layer and exported by mixquant, against ModelOpt's
    mtq.quantize (mse + fp8_scale_sweep NVFP4, MSE FP8, the same calibration batches) + export_hf_checkpoint:
    every tensor's name, dtype, shape and bytes, and hf_quant_config.json (the producer apart; MiniMax-M2's
    quantized_layers keys are vLLM's). vLLM 0.33's own resolution then gives each MoE layer its format."""
    from mixquant.export.checkpoint import export_checkpoint
    from mixquant.export.run import checkpoint_audit
    from mixquant.producer import default_producer
    from mixquant.quantize.activations import collect_activation_stats
    from mixquant.quantize.layer import quantize_layer, save_layer_result
    from mixquant.quantize.reference import modelopt_reference_export

    arch = architecture(instance)
    model_type = _model_type(instance)
    placement = dict(zip(arch.moe_layers, (NVFP4, FP8, BF16), strict=False))
    ids = _ids(8, 32, seed=3)
    stats = collect_activation_stats(instance, ids, batch_size=4, progress=False)
    params = {NVFP4: {"calibration": "fp8_sweep"}, FP8: {"weight_calibration": "mse"}, BF16: {}}
    layer_dirs = {}
    for layer in arch.moe_layers:
        fmt = placement.get(layer, BF16)
        amax = {"gate_up": stats["gate_up_input_amax"][layer], "down": stats["down_input_amax"][layer]}
        tensors, audit = quantize_layer(
            instance, layer, fmt, params[fmt], activation_amax=amax if fmt == FP8 else None
        )
        save_layer_result(tensors, audit, tmp_path / "layers" / str(layer))
        layer_dirs[layer] = (fmt, tmp_path / "layers" / str(layer))
    ours_dir = tmp_path / "ours"
    export_checkpoint(
        instance, layer_dirs, ours_dir, tokenizer_dir=instance, producer=default_producer(), fsync=False
    )
    theirs_dir = tmp_path / "modelopt"
    modelopt_reference_export(
        instance,
        ids,
        placement,
        theirs_dir,
        nvfp4_algorithm="fp8_sweep",
        fp8_weight_algorithm="mse",
        batch_size=4,
    )
    ours, theirs = (
        _read_all(sorted(ours_dir.glob("*.safetensors"))),
        _read_all(sorted(theirs_dir.glob("*.safetensors"))),
    )
    assert set(ours) == set(theirs)
    source = _read_all(sorted(instance.glob("*.safetensors")))
    # ModelOpt exports what transformers holds in memory: a tensor the publisher wrote in a narrower dtype
    # than the class holds (DeepSeek-V3's BF16 router weights, float32 in DeepseekV3TopkRouter) comes out
    # widened; mixquant copies the source's bytes. The values are the same.
    copied = {name: tensor for name, tensor in theirs.items() if not arch.routed_expert_of(name)}
    widened = {name for name, tensor in copied.items() if source[name].dtype != tensor.dtype}
    casts = PUBLISHED_DTYPES.get(model_type, {})
    assert widened == {name for name in source for suffix in casts if name.endswith(suffix)}
    for name, tensor in ours.items():
        expected = theirs[name]
        if name in widened:
            assert tensor.dtype == source[name].dtype, name
            assert torch.equal(tensor.to(expected.dtype), expected), name
            continue
        assert tensor.dtype == expected.dtype and tensor.shape == expected.shape, name
        assert torch.equal(tensor.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)), name
    # the audit the export ships predicts the export from config.json and the source's non-expert dtypes
    audit = checkpoint_audit(ours_dir, placement, None, default_producer(), instance)
    assert all(audit["agreement"].values()), audit["agreement"]
    if widened:  # transformers' dtypes alone would predict the widened bytes
        blind = checkpoint_audit(ours_dir, placement, None, default_producer())
        assert blind["agreement"]["payload_bytes"] is False
    routed = [name for name in ours if arch.routed_expert_of(name)]
    assert len(routed) == 8 * 3 * (3 + 3 + (1 if len(arch.moe_layers) > 2 else 0))

    def quant_config(directory: Path) -> dict:
        data = json.loads((directory / "hf_quant_config.json").read_text())
        data.pop("producer", None)
        return data

    expected = quant_config(theirs_dir)
    expected["quantization"]["quantized_layers"] = arch.vllm_quantized_layers(
        expected["quantization"]["quantized_layers"]
    )
    assert quant_config(ours_dir) == expected
    resolved = resolve_quantized_layers(ours_dir, model_type)
    assert unmatched_quantized_layers(ours_dir, model_type) == []
    assert {int(prefix.split(".")[2]): algo for prefix, algo in resolved.items()} == {
        layer: ALGOS[placement.get(layer, BF16)] for layer in arch.moe_layers
    }
