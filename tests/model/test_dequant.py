"""Loading an export back as BF16 (mixquant.model.dequant): exact for BF16, else ModelOpt's dequantization.

* BF16-only placement: the dequantized model's logits equal the source model's bit for bit.
* Mixed NVFP4 / FP8 / BF16 placement: every dequantized routed-expert weight equals ModelOpt's own
  ``NVFP4QTensor`` / ``FP8QTensor`` dequantization of the exported tensors, for export_checkpoint's
  output and for ModelOpt's own export alike (the two are byte-identical, so their dequantized state dicts
  are too); everything else is the source tensor; no scale tensor survives.
"""

from __future__ import annotations

import contextlib
import io
import json
import warnings

import pytest
import torch

warnings.filterwarnings("ignore", message="transformers .* is not tested")

from mixquant.export.checkpoint import export_checkpoint  # noqa: E402
from mixquant.formats.nvfp4 import BLOCK_SIZE  # noqa: E402
from mixquant.model import layout, toy_layout  # noqa: E402
from mixquant.model.dequant import load_dequantized_model, load_dequantized_state_dict  # noqa: E402
from mixquant.model.tokenizer import SPECIAL_TOKENS  # noqa: E402
from mixquant.model.toy import init_toy_model, to_bfloat16, toy_laguna_config  # noqa: E402
from mixquant.producer import default_producer  # noqa: E402
from mixquant.quantize.layer import quantize_layer, save_layer_result  # noqa: E402
from mixquant.quantize.reference import BF16, FP8, NVFP4, modelopt_reference_export  # noqa: E402
from safetensors import safe_open  # noqa: E402
from transformers import LagunaForCausalLM  # noqa: E402

torch.set_num_threads(1)
cpu_reference = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU reference (the NVFP4 fake-quant patch is CPU-only)"
)

NUM_EXPERTS = 16
MOE_LAYERS = (1, 2, 3, 4)
PLACEMENT = {1: NVFP4, 2: FP8, 3: BF16, 4: FP8}
BATCH_SIZE = 2
ARCH = {
    "num_hidden_layers": 5,
    "hidden_size": 32,
    "head_dim": 16,
    "num_attention_heads_full": 2,
    "num_attention_heads_sliding": 4,
    "num_key_value_heads": 2,
    "sliding_window": 8,
    "intermediate_size": 64,
    "num_experts": NUM_EXPERTS,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16,
}


class StubTokenizer:
    def __len__(self) -> int:
        return 128

    def convert_tokens_to_ids(self, token: str) -> int:
        return SPECIAL_TOKENS.index(token)


def quiet():
    stack = contextlib.ExitStack()
    stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
    stack.enter_context(contextlib.redirect_stderr(io.StringIO()))
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")
    return stack


def read_tensors(directory) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in sorted(directory.glob("*.safetensors")):
        with safe_open(shard, "pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensors[name] = handle.get_tensor(name)
    return tensors


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    config = toy_laguna_config(ARCH, StubTokenizer())
    model = init_toy_model(config, seed=11, router_bias_init_std=0.05)
    with torch.no_grad():
        for layer in MOE_LAYERS:
            model.model.layers[layer].mlp.gate.weight.mul_(20.0)
    to_bfloat16(model)
    out = tmp_path_factory.mktemp("src")
    with quiet():
        toy_layout.save_upstream_checkpoint(model, out, num_shards=2)
    (out / "tokenizer.json").write_text("{}")
    return out


def export(source, placement, out, layer_root, amax=None, **kwargs):
    layer_dirs = {}
    for layer in MOE_LAYERS:
        fmt = placement.get(layer, BF16)
        params = {NVFP4: {"calibration": "max"}, FP8: {"weight_calibration": "max"}, BF16: {}}[fmt]
        tensors, audit = quantize_layer(source, layer, fmt, params, activation_amax=(amax or {}).get(layer))
        save_layer_result(tensors, audit, layer_root / f"L{layer}")
        layer_dirs[layer] = (fmt, layer_root / f"L{layer}")
    return export_checkpoint(
        source, layer_dirs, out, tokenizer_dir=source, producer=default_producer(), fsync=False, **kwargs
    )


def test_bf16_placement_logits_equal_source(source, tmp_path):
    amax = {"k_amax": dict.fromkeys(range(5), 3.0), "v_amax": dict.fromkeys(range(5), 2.0)}
    export(source, {}, tmp_path / "out", tmp_path / "layers", num_shards=3, kv_cache="fp8", kv_amax=amax)
    state = load_dequantized_state_dict(tmp_path / "out")
    src = read_tensors(source)
    assert sorted(state) == sorted(src)  # KV-cache scales dropped
    assert all(torch.equal(bits(state[n]), bits(src[n])) and state[n].dtype == src[n].dtype for n in src)

    ids = torch.randint(4, 128, (2, 10), generator=torch.Generator().manual_seed(3))
    with quiet():
        reference = LagunaForCausalLM.from_pretrained(source, dtype=torch.bfloat16).eval()
        model = load_dequantized_model(tmp_path / "out")
    assert "quantization_config" in json.loads((tmp_path / "out" / "config.json").read_text())
    assert not hasattr(model.config, "quantization_config")
    with torch.no_grad():
        expected = reference(input_ids=ids, use_cache=False).logits
        got = model(input_ids=ids, use_cache=False).logits
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)
    ref_sd, got_sd = reference.state_dict(), model.state_dict()
    assert sorted(ref_sd) == sorted(got_sd)
    assert all(torch.equal(got_sd[n], ref_sd[n]) for n in ref_sd)


def modelopt_dequantized(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """ModelOpt's own QTensor dequantization of one exported weight (fp32 -> bf16), independently here."""
    from modelopt.torch.quantization.qtensor import FP8QTensor, NVFP4QTensor

    base = name.removesuffix(".weight")
    weight = tensors[name]
    if weight.dtype == torch.uint8:
        shape = torch.Size((*weight.shape[:-1], weight.shape[-1] * 2))
        deq = NVFP4QTensor(shape, torch.float32, weight).dequantize(
            dtype=torch.float32,
            scale=tensors[f"{base}.weight_scale"],
            double_scale=tensors[f"{base}.weight_scale_2"],
            block_sizes={-1: BLOCK_SIZE},
        )
    else:
        deq = FP8QTensor(weight.shape, torch.float32, weight).dequantize(
            dtype=torch.float32, scale=tensors[f"{base}.weight_scale"]
        )
    return deq.to(torch.bfloat16)


@cpu_reference
def test_mixed_placement_equals_modelopt_dequantization(source, tmp_path):
    ids = torch.randint(4, 128, (5, 12), generator=torch.Generator().manual_seed(2))
    with quiet():
        modelopt_reference_export(
            source,
            ids,
            dict(PLACEMENT),
            tmp_path / "ref",
            nvfp4_algorithm="max",
            fp8_weight_algorithm="max",
            batch_size=BATCH_SIZE,
        )
    ref = read_tensors(tmp_path / "ref")
    amax = {}  # the FP8 layers' input amax, recovered exactly from ModelOpt's layer-shared input_scale
    for layer, fmt in PLACEMENT.items():
        if fmt == FP8:
            p = f"model.layers.{layer}.mlp.experts.0"
            amax[layer] = {
                "gate_up": (ref[f"{p}.gate_proj.input_scale"] * 448).to(torch.bfloat16).float(),
                "down": (ref[f"{p}.down_proj.input_scale"] * 448).to(torch.bfloat16).float(),
            }
    export(source, PLACEMENT, tmp_path / "ours", tmp_path / "layers", amax=amax)
    ours = read_tensors(tmp_path / "ours")
    assert sorted(ours) == sorted(ref) and all(torch.equal(bits(ours[n]), bits(ref[n])) for n in ref)

    state = load_dequantized_state_dict(tmp_path / "ours")
    state_ref = load_dequantized_state_dict(tmp_path / "ref")  # ModelOpt's own export directory
    src = read_tensors(source)
    assert sorted(state) == sorted(state_ref) == sorted(src)
    counted = {NVFP4: 0, FP8: 0}
    for name, tensor in state.items():
        assert tensor.dtype == torch.bfloat16 and tensor.shape == src[name].shape, name
        assert torch.equal(bits(tensor), bits(state_ref[name])), name
        layer = layout.layer_of(name)
        fmt = PLACEMENT.get(layer) if ".mlp.experts." in name and name.endswith("_proj.weight") else None
        if fmt in (NVFP4, FP8):
            assert torch.equal(bits(tensor), bits(modelopt_dequantized(ours, name))), name
            assert not torch.equal(tensor, src[name]), name  # really quantized
            counted[fmt] += 1
        else:
            assert torch.equal(bits(tensor), bits(src[name])), name
    assert counted == {NVFP4: NUM_EXPERTS * 3, FP8: 2 * NUM_EXPERTS * 3}

    with quiet():
        model = load_dequantized_model(tmp_path / "ours")
    experts = model.model.layers[1].mlp.experts
    gate_up = torch.cat(
        [
            state["model.layers.1.mlp.experts.5.gate_proj.weight"],
            state["model.layers.1.mlp.experts.5.up_proj.weight"],
        ]
    )
    assert torch.equal(experts.gate_up_proj[5], gate_up)
    assert torch.equal(
        model.model.layers[2].mlp.experts.down_proj[3], state["model.layers.2.mlp.experts.3.down_proj.weight"]
    )
    with torch.no_grad():
        logits = model(input_ids=ids[:2], use_cache=False).logits
    assert bool(torch.isfinite(logits).all())


def test_missing_scale_is_an_error(source, tmp_path):
    from mixquant.model.dequant import load_dequantized_state_dict as load
    from safetensors.torch import save_file

    bad = {
        "model.layers.1.mlp.experts.0.gate_proj.weight": torch.zeros(4, 8, dtype=torch.uint8),
        "model.layers.1.mlp.experts.0.gate_proj.weight_scale": torch.ones(4, 1).to(torch.float8_e4m3fn),
    }
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="without its scale tensors"):
        load(tmp_path)
