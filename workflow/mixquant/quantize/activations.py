"""Activation statistics of the BF16 model, collected in one forward pass without ModelOpt.

A streaming per-layer quantizer needs the activation ranges that ModelOpt's calibration would have seen,
without running ModelOpt on the whole model. :func:`collect_activation_stats` runs the *unquantized*
MoE model (``AutoModelForCausalLM``: any family of :mod:`mixquant.model.families`; bf16, eval, no
grad) over the calibration token ids, ``batch_size`` sequences per forward with no attention mask and
``use_cache=False`` -- exactly the forward loop of
:func:`mixquant.quantize.reference.modelopt_reference_export` -- and records, through hooks:

Routed experts, every MoE layer ``L`` (module ``model.layers.L.mlp.experts``)
    What ModelOpt's shared per-layer FP8 input quantizers of ``_QuantFusedExperts`` see: the inputs of the
    two ``F.linear`` calls of the eager expert loop (``LagunaExperts.forward``). While the experts module
    runs, ``torch.nn.functional.linear`` is intercepted (:mod:`mixquant.model.experts`, the one place that
    does); a call whose weight is a view of ``gate_up_proj`` / ``down_proj`` is attributed to that
    projection and to expert ``(offset - base) // stride(0)`` (the rule ModelOpt uses), and its *input* is
    reduced.

    * ``gate_up_input_amax_per_expert`` [E]: max |x| of ``hidden_states[token_idx]`` (the tokens routed
      top-k to expert e, after ``post_attention_layernorm``), bf16 as in the model;
    * ``down_input_amax_per_expert`` [E]: max |act(gate) * up| on the same tokens, the bf16 tensor the
      model itself feeds to the down projection (not a recomputation);
    * ``gate_up_input_amax`` / ``down_input_amax``: their max over experts == ModelOpt's running max over
      all calls of the layer's one ``gate_up_proj_input_quantizer`` / ``down_proj_input_quantizer``;
    * ``routed_tokens`` [E] (int64): tokens routed to each expert (from the router's ``top_k_index``, an
      expert never chosen counts 0 and has per-expert amaxes 0). Cross-checked against the rows the
      intercepted linears received, so a non-eager expert backend (grouped_mm / batched_mm, which bypass
      ``F.linear``) fails loudly instead of recording nothing.

Attention, every layer ``L`` (module ``model.layers.L.self_attn``)
    ``k_amax`` / ``v_amax``: max |K| and max |V| of the key / value states handed to the attention
    function (``ALL_ATTENTION_FUNCTIONS[impl]``, or ``eager_attention_forward``) -- the tensors a KV cache
    stores and what ModelOpt's ``_QuantAttention.k_bmm_quantizer`` / ``v_bmm_quantizer`` see: K after
    ``k_proj``, ``k_norm`` and RoPE; V after ``v_proj`` (reshaped to heads, no norm, no RoPE); both
    ``[B, num_key_value_heads, T, head_dim]`` before ``repeat_kv``. The attention function is wrapped for
    the duration of the collection only (the same patch ModelOpt applies per forward).

Every amax is reduced the way ModelOpt's ``MaxCalibrator`` does (``reduce_amax`` with ``axis=None``:
``max(|max(x)|, |min(x)|)`` in the activation dtype, bf16), which is exact, and is stored as fp32 (exact for
a bf16 value). ModelOpt keeps the calibrated amax in bf16 and exports ``input_scale = amax.float() / 448``,
so ``fp32(amax) / 448`` here is bit-identical to its exported ``input_scale`` (see
:func:`modelopt_fp8_input_scale` for the zero / NaN rule of its export).

Bit-exactness conditions (the model's bf16 arithmetic must be the same, not just the token set): same
checkpoint and dtype, ``experts_implementation="eager"`` (ModelOpt forces it,
``force_eager_experts_impl_on_the_fly``; transformers' default grouped_mm rounds differently), the same
attention implementation (``sdpa``, transformers' default, which ModelOpt does not change), the same
``batch_size`` (GEMM kernels may round a row differently depending on how many rows are in the batch) and,
on CPU, the same thread count.

Storage (:func:`save_activation_stats`): ``activation_stats.safetensors`` with tensors
``layers.{L}.{stat}`` and string metadata, plus ``activation_stats.json`` (a readable summary).
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from mixquant.calibration.tokens import calibration_batches
from mixquant.checkpoint.atomic import atomic_path, write_text_atomic
from mixquant.checkpoint.writer import save_file_sorted
from mixquant.formats.facts import FP8_E4M3_MAX
from mixquant.model.attention import attention_kv_hook
from mixquant.model.experts import ExpertIntercept, intercept_expert_linears
from mixquant.model.families import moe_experts
from mixquant.model.streaming import StreamedModel, resolve_device

__all__ = [
    "ATTENTION_STATS",
    "EXPERT_STATS",
    "FP8_E4M3_MAX",
    "JSON_NAME",
    "SAFETENSORS_NAME",
    "collect_activation_stats",
    "load_activation_stats",
    "modelopt_fp8_input_scale",
    "save_activation_stats",
]

SAFETENSORS_NAME = "activation_stats.safetensors"
JSON_NAME = "activation_stats.json"
FORMAT_VERSION = "1"

# Per MoE layer.
EXPERT_STATS = (
    "gate_up_input_amax",
    "down_input_amax",
    "gate_up_input_amax_per_expert",
    "down_input_amax_per_expert",
    "routed_tokens",
)
# Per layer (all layers).
ATTENTION_STATS = ("k_amax", "v_amax")
STATS = EXPERT_STATS + ATTENTION_STATS

WHERE = {
    "gate_up_input_amax": "max over experts of gate_up_input_amax_per_expert (ModelOpt's shared "
    "gate_up_proj_input_quantizer of model.layers.L.mlp.experts)",
    "down_input_amax": "max over experts of down_input_amax_per_expert (ModelOpt's shared "
    "down_proj_input_quantizer)",
    "gate_up_input_amax_per_expert": "max |x| of the input of F.linear(x, gate_up_proj[e]) in the eager "
    "expert loop: post_attention_layernorm output of the tokens routed (top-k) to expert e",
    "down_input_amax_per_expert": "max |x| of the input of F.linear(x, down_proj[e]): act(gate) * up as "
    "computed by the model (bf16) on expert e's routed tokens",
    "routed_tokens": "number of tokens routed to expert e (router top_k_index)",
    "k_amax": "max |K| of the key states passed to the attention function: k_proj -> k_norm -> RoPE, "
    "[B, kv_heads, T, head_dim] before repeat_kv (what a KV cache stores)",
    "v_amax": "max |V| of the value states passed to the attention function: v_proj output reshaped to "
    "[B, kv_heads, T, head_dim] before repeat_kv (what a KV cache stores)",
}


def _amax(x: torch.Tensor) -> torch.Tensor:
    """ModelOpt's ``reduce_amax(x, axis=None)``: ``max(|max(x)|, |min(x)|)`` in x's dtype (exact), as fp32."""
    return torch.maximum(torch.abs(torch.max(x)), torch.abs(torch.min(x))).float()


def modelopt_fp8_input_scale(amax: torch.Tensor) -> torch.Tensor:
    """The ``input_scale`` ModelOpt 0.47 exports for a static per-tensor FP8 quantizer with this ``amax``.

    ``TensorQuantizer.export_amax`` replaces a zero or NaN amax by ``maxbound`` (448, so the scale is 1.0)
    and clamps to ``[tiny, max]`` of the amax dtype; ``get_scaling_factor`` returns ``amax.float() / 448``.
    For a positive amax taken from bf16 activations this is just ``fp32(amax) / 448``.
    """
    amax = torch.as_tensor(amax).float()
    amax = torch.where(amax == 0, torch.full_like(amax, FP8_E4M3_MAX), amax)
    amax = torch.nan_to_num(amax, nan=FP8_E4M3_MAX)
    finfo = torch.finfo(torch.bfloat16)
    return amax.clamp(min=finfo.tiny, max=finfo.max) / FP8_E4M3_MAX


# ----------------------------------------------------------------------------------------- hooks


class _ExpertRecorder(ExpertIntercept):
    """Per-MoE-layer accumulators, fed by the experts module's arguments and its intercepted ``F.linear``."""

    def __init__(self, layer: int, experts: torch.nn.Module, device: torch.device):
        self.layer = layer
        self.experts = experts
        n = int(experts.num_experts)
        self.num_experts = n
        self.gate_up = torch.zeros(n, dtype=torch.float32, device=device)
        self.down = torch.zeros(n, dtype=torch.float32, device=device)
        self.routed = torch.zeros(n, dtype=torch.int64, device=device)
        self.rows_gate_up = torch.zeros(n, dtype=torch.int64)
        self.rows_down = torch.zeros(n, dtype=torch.int64)

    def enter(self, args: tuple) -> None:
        hidden_states, top_k_index = args[0], args[1]
        if hidden_states.dim() != 2:
            raise RuntimeError(f"layer {self.layer}: expected [tokens, hidden] expert input")
        self.route(top_k_index)

    def linear_input(self, input: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        self.record(input, weight)
        return input

    def expert_of(self, weight: torch.Tensor, param: torch.Tensor) -> int | None:
        """Expert index if ``weight`` is a ``param[e]`` view (same storage), else None."""
        if weight.untyped_storage().data_ptr() != param.untyped_storage().data_ptr():
            return None
        idx = (weight.storage_offset() - param.storage_offset()) // param.stride(0)
        if not 0 <= idx < self.num_experts or weight.shape != param.shape[1:]:
            raise RuntimeError(f"layer {self.layer}: F.linear weight is not an expert slice of {param.shape}")
        return int(idx)

    def record(self, x: torch.Tensor, weight: torch.Tensor) -> None:
        for param, acc, rows in (
            (self.experts.gate_up_proj, self.gate_up, self.rows_gate_up),
            (self.experts.down_proj, self.down, self.rows_down),
        ):
            e = self.expert_of(weight, param)
            if e is not None:
                if x.numel():
                    acc[e] = torch.maximum(acc[e], _amax(x))
                rows[e] += x.reshape(-1, x.shape[-1]).shape[0]
                return

    def route(self, top_k_index: torch.Tensor) -> None:
        counts = torch.bincount(top_k_index.reshape(-1), minlength=self.num_experts + 1)
        self.routed += counts[: self.num_experts]  # index num_experts: EP sentinel, not an expert

    def result(self) -> dict[str, torch.Tensor]:
        routed = self.routed.cpu()
        for kind, rows in (("gate_up", self.rows_gate_up), ("down", self.rows_down)):
            if not torch.equal(rows, routed):
                raise RuntimeError(
                    f"layer {self.layer}: the {kind} expert linears saw {rows.tolist()} rows but the router "
                    f"sent {routed.tolist()} tokens; is experts_implementation 'eager'?"
                )
        gate_up, down = self.gate_up.cpu(), self.down.cpu()
        return {
            "gate_up_input_amax": gate_up.max(),
            "down_input_amax": down.max(),
            "gate_up_input_amax_per_expert": gate_up,
            "down_input_amax_per_expert": down,
            "routed_tokens": routed,
        }


@contextlib.contextmanager
def _intercept_attention(model: torch.nn.Module, k_amax: dict, v_amax: dict) -> Iterator[None]:
    """Record max |K| / |V| handed to the attention function (after k_norm + RoPE / after v_proj)."""

    def record(layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for store, x in ((k_amax, key), (v_amax, value)):
            amax = _amax(x)
            store[layer] = amax if layer not in store else torch.maximum(store[layer], amax)
        return key, value

    with attention_kv_hook(model, record):
        yield


# ----------------------------------------------------------------------------------------- collection


def collect_activation_stats(
    model_dir: str | Path,
    calibration_ids: torch.Tensor,
    *,
    batch_size: int = 8,
    threads: int | None = None,
    progress: bool = True,
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
    streamed: bool = True,
    reader: Any = None,
) -> dict:
    """Activation amaxes of the BF16 model in ``model_dir`` over ``calibration_ids`` ([N, T] token ids).

    The forward of the model (bf16, eval, no grad, eager experts, ``attn_implementation``) on
    ``batch_size`` sequences at a time, no attention mask, ``use_cache=False``. Streamed (the default,
    :class:`mixquant.model.streaming.StreamedModel`): layer-major, each decoder layer read once and every
    batch run through it before the next is loaded, so memory holds about two layers plus the
    calibration's hidden states; ``streamed=False`` loads the whole model and runs batch after batch (the
    reference the streamed statistics equal bit for bit). ``threads`` sets ``torch.set_num_threads`` for
    the duration (restored after). See the module docstring for where each statistic is taken and what
    must match ModelOpt's calibration for bit-exact results.

    Returns ``{stat: {layer: tensor}}`` for the stats in ``EXPERT_STATS`` (MoE layers) and
    ``ATTENTION_STATS`` (all layers), plus ``"metadata"``: a ``dict[str, str]``.
    """
    import transformers
    from tqdm import tqdm

    batches = calibration_batches(calibration_ids, batch_size)
    ids = calibration_ids.detach().to(torch.long)
    device = resolve_device(device)
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(int(threads))
    stream = None
    try:
        if streamed:
            stream = StreamedModel(model_dir, device=device, reader=reader)
            model = stream.model
        else:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(
                Path(model_dir),
                dtype=torch.bfloat16,
                experts_implementation="eager",
                attn_implementation=attn_implementation,
            )
            model.to(device).eval()
        config = model.config
        if config._experts_implementation != "eager":
            raise RuntimeError(f"experts implementation is {config._experts_implementation!r}, need 'eager'")
        layers = model.model.layers
        experts = moe_experts(model)
        moe = sorted(experts)
        recorders = {i: _ExpertRecorder(i, experts[i], device) for i in moe}
        k_amax: dict[int, torch.Tensor] = {}
        v_amax: dict[int, torch.Tensor] = {}
        with (
            torch.no_grad(),
            intercept_expert_linears({rec.experts: rec for rec in recorders.values()}),
            _intercept_attention(model, k_amax, v_amax),
        ):
            if stream is not None:
                stream.forward(batches, logits=False, progress="activation stats" if progress else None)
            else:
                for batch in tqdm(
                    batches, desc="activation stats", unit="batch", file=sys.stderr, disable=not progress
                ):
                    # model.model: the decoder stack only (the lm_head cannot influence any statistic)
                    model.model(input_ids=batch.to(device), use_cache=False)
        used_threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(old_threads)
        if stream is not None:
            stream.close()

    stats: dict[str, Any] = {name: {} for name in STATS}
    for layer, rec in recorders.items():
        for name, value in rec.result().items():
            stats[name][layer] = value
    missing = sorted(set(range(len(layers))) - set(k_amax))
    if missing:
        raise RuntimeError(f"attention of layers {missing} was not intercepted")
    for layer in range(len(layers)):
        stats["k_amax"][layer] = k_amax[layer].cpu()
        stats["v_amax"][layer] = v_amax[layer].cpu()
    stats["metadata"] = {
        "format_version": FORMAT_VERSION,
        "batch_size": str(batch_size),
        "num_sequences": str(ids.shape[0]),
        "seq_len": str(ids.shape[1]),
        "num_tokens": str(ids.numel()),
        "num_batches": str(len(batches)),
        "num_hidden_layers": str(len(layers)),
        "moe_layers": json.dumps(moe),
        "num_experts": str(int(experts[moe[0]].num_experts)),
        "num_experts_per_tok": str(int(config.num_experts_per_tok)),
        "dtype": "bfloat16",
        "experts_implementation": str(config._experts_implementation),
        "attn_implementation": str(config._attn_implementation),
        "device": device.type,  # the index does not decide numbers (and must not change bytes)
        "threads": str(used_threads),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "where": json.dumps(WHERE, sort_keys=True),
    }
    return stats


# ----------------------------------------------------------------------------------------- storage


def _tensor_name(layer: int, stat: str) -> str:
    return f"layers.{int(layer)}.{stat}"


def save_activation_stats(stats: dict, out_dir: Path) -> None:
    """Write ``activation_stats.safetensors`` (tensors ``layers.{L}.{stat}`` + string metadata) and
    ``activation_stats.json`` (metadata and the values, for reading) to ``out_dir``; atomic renames."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    summary_layers: dict[str, dict[str, Any]] = {}
    for stat in STATS:
        for layer, value in sorted(stats[stat].items()):
            dtype = torch.int64 if stat == "routed_tokens" else torch.float32
            if value.dtype != dtype:
                raise ValueError(f"{stat}[{layer}]: expected {dtype}, got {value.dtype}")
            tensors[_tensor_name(layer, stat)] = value.detach().cpu().contiguous()
            summary_layers.setdefault(str(layer), {})[stat] = value.tolist()
    metadata = dict(stats.get("metadata", {}))
    bad = [k for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)]
    if bad:
        raise ValueError(f"metadata must be dict[str, str]; offending keys {bad!r}")
    summary = {
        "metadata": {k: v for k, v in metadata.items() if k != "where"},
        "where": json.loads(metadata["where"]) if "where" in metadata else WHERE,
        "layers": summary_layers,
    }
    with atomic_path(out_dir / SAFETENSORS_NAME) as tmp:
        save_file_sorted(tensors, tmp, metadata)
    write_text_atomic(out_dir / JSON_NAME, json.dumps(summary, indent=1, sort_keys=True) + "\n")


def load_activation_stats(path: Path) -> dict:
    """Read what :func:`save_activation_stats` wrote (``path``: the .safetensors file or its directory);
    returns the structure of :func:`collect_activation_stats`."""
    from safetensors import safe_open

    path = Path(path)
    if path.is_dir():
        path = path / SAFETENSORS_NAME
    stats: dict[str, Any] = {name: {} for name in STATS}
    with safe_open(str(path), framework="pt") as handle:
        metadata = dict(handle.metadata() or {})
        for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
            prefix, layer, stat = name.split(".", 2)
            if prefix != "layers" or stat not in stats:
                raise ValueError(f"{path}: unexpected tensor {name!r}")
            stats[stat][int(layer)] = handle.get_tensor(name)
    stats = {stat: dict(sorted(values.items())) for stat, values in stats.items()}
    stats["metadata"] = metadata
    return stats
