"""Streaming, per-layer quantization of Laguna routed experts: bit-identical to ModelOpt's HF export.

One MoE layer at a time, one expert at a time, straight from the upstream shards (never the whole model):
:func:`quantize_layer` produces exactly the tensors ``modelopt_reference_export``
(:mod:`mixquant.quantize.reference`: ``mtq.quantize`` + ``export_hf_checkpoint``) writes for that layer's
routed experts, under the same names, dtypes and shapes, byte for byte. What ModelOpt 0.47 does, and
what is reproduced here (see :mod:`mixquant.quantize.reference` for the module/quantizer structure):

* One weight quantizer per expert covers the *fused* ``[2I, H]`` gate+up slice (gate rows first), another
  the ``[H, I]`` down slice. Export splits the fused one into ``gate_proj`` / ``up_proj`` with copies of
  the same quantizer, so gate and up share every per-tensor quantity.
* ``nvfp4_w4a16`` (static E2M1 weights, E4M3 scale per 16 elements of the input dim, fp32
  ``weight_scale_2 = global_amax / (6 * 448)``): ``global_amax`` is max |w| over gate+up (shared) and
  over down. Per-block amax by

  - ``fp8_sweep`` (``{"method": "mse", "fp8_scale_sweep": True}``): :func:`sweep_nvfp4_block_amax`;
  - ``max``: max |w| per block;
  - ``mse`` (``{"method": "mse"}``): ModelOpt's multiplier search -- ``MseCalibrator`` started from the
    per-block max amax, 39 multipliers ``linspace(0.25, 4, 39)``, each candidate ``amax * m`` fake
    quantized through the static NVFP4 quantizer with ``global_amax`` fixed, per-block fp32 squared
    error summed over the block, first argmin per block, result kept in fp32 (static block quantizers
    keep their amax in fp32). :func:`nvfp4_mse_block_amax` runs ModelOpt's own ``MseCalibrator`` with the
    static fake quant of :mod:`mixquant.formats.cpu_fake_quant` (= ModelOpt's export numerics), block
    rows in chunks (blocks are independent, so chunking changes nothing).

  Then :func:`nvfp4_export_tensors` (``NVFP4QTensor``): ``weight`` uint8 ``[N, K/2]``, ``weight_scale``
  float8_e4m3fn ``[N, K/16]``, ``weight_scale_2`` fp32 0-dim. No ``input_scale`` (W4A16).
* ``fp8`` (per-tensor E4M3 weights and static per-tensor E4M3 inputs): weight amax by ``max`` or ``mse``
  (:func:`fp8_mse_weight_amax`, rounded to bf16 like ModelOpt's ``_amax`` buffer) over
  ``torch.cat([gate, up])`` (shared by gate and up) and over down; :func:`fp8_export_tensors`.
  ``input_scale = fp32(amax) / 448`` from the layer's *shared* input quantizers -- ``gate_up`` for gate
  and up, ``down`` for down -- so every expert of the layer gets the same two values, including experts
  that never received a calibration token. They are arguments here (``activation_amax``).
* ``bf16``: the source tensors, unchanged.

Source dtype must be bfloat16 (the reference loads the model in bf16; the FP8 export divides in bf16).
Bit-exactness caveat (FP8 ``mse`` only): the loss is a ``torch.sum`` over the whole fused weight whose
summation order depends on device and, above 32768 elements on CPU, on torch's thread count; run with the
same settings as the reference for a guaranteed byte match (see :mod:`mixquant.formats.fp8`).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Iterator, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from mixquant.checkpoint.shards import CheckpointError, read_safetensors_header
from mixquant.export.predict import NVFP4_GROUP_SIZE as BLOCK_SIZE
from mixquant.formats.fp8 import FP8_E4M3_MAX, fp8_export_tensors, fp8_max_amax, fp8_mse_weight_amax
from mixquant.model.layout import CONFIG_FILE, INDEX_FILE, SAFETENSORS_METADATA, mlp_layer_types, natural_key

from .reference import BF16, FP8, NVFP4

__all__ = [
    "AUDIT_FILE",
    "FORMATS",
    "FP8_WEIGHT_CALIBRATIONS",
    "INPUT_SCALE_SOURCE",
    "LAYER_FILE",
    "NVFP4_CALIBRATIONS",
    "PROJECTIONS",
    "QuantizeInputError",
    "dequantize_tensors",
    "expert_weight_name",
    "nvfp4_block_amax",
    "nvfp4_mse_block_amax",
    "quantize_layer",
    "read_layer_experts",
    "save_layer_result",
]

FORMATS = (NVFP4, FP8, BF16)
NVFP4_CALIBRATIONS = ("fp8_sweep", "max", "mse")
FP8_WEIGHT_CALIBRATIONS = ("mse", "max")
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
LAYER_FILE = "layer.safetensors"
AUDIT_FILE = "audit.json"
INPUT_SCALE_SOURCE = "layer-shared (ModelOpt per-layer input quantizer)"
SINGLE_FILE = "model.safetensors"

_PARAM_KEYS = {NVFP4: {"calibration"}, FP8: {"weight_calibration"}, BF16: set()}
_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_WEIGHT_SUFFIX = ".weight"
# Accepted spellings of the two layer-shared activation amaxes (the first is canonical).
_AMAX_KEYS = {"gate_up": ("gate_up", "gate_up_input_amax"), "down": ("down", "down_input_amax")}
_MSE_CHUNK_BLOCKS = 1 << 16  # NVFP4 multiplier MSE: blocks per ModelOpt calibrator (~4 MiB fp32 input)


# Bad quantization input (checkpoint, layer, parameters): one line naming the culprit. The checkpoint
# reader's error, so a broken shard is the same error wherever it is found.
QuantizeInputError = CheckpointError


# The qwen2_moe-style expert names (Laguna, Qwen3-MoE, DeepSeek-V3, GLM): what a checkpoint directory
# without a config.json naming its model_type is read with; otherwise the family's own names
# (mixquant.model.families.Architecture.expert_weight).
_DEFAULT_TEMPLATES = {p: f"model.layers.{{layer}}.mlp.experts.{{expert}}.{p}.weight" for p in PROJECTIONS}


def expert_weight_name(layer: int, expert: int, proj: str) -> str:
    """Upstream name of one routed-expert weight in the qwen2_moe-style layout (Laguna's):
    ``model.layers.L.mlp.experts.E.{proj}.weight``."""
    return _DEFAULT_TEMPLATES[proj].format(layer=int(layer), expert=int(expert))


# ----------------------------------------------------------------------------------------- reading


def check_checkpoint_shards(model_dir: Path) -> int:
    """Validate every safetensors shard's header and size before a whole-model load.

    Whole-model readers (the activation-statistics forward) call this first so that a truncated or
    corrupt shard stops them with one line naming the file, as it stops quantize_layer.
    Returns the number of shards checked.
    """
    shards = sorted(Path(model_dir).glob("*.safetensors"))
    for shard in shards:
        read_safetensors_header(shard)
    return len(shards)


def _load_json(path: Path, what: str) -> Any:
    from mixquant.jsonio import read_json

    return read_json(path, what, error=QuantizeInputError)


class _LayerSource:
    """The routed-expert tensors of one layer in an upstream checkpoint: index, headers, lazy reads.

    Construction checks everything that can be checked without reading tensor data: the index (or the
    single ``model.safetensors``), the expected tensor names (``num_experts`` from config.json, else the
    expert ids in the index, which must be 0..E-1 with all three projections), every needed shard's header
    and size, dtype bfloat16 and consistent ``[I, H]`` / ``[H, I]`` shapes. :meth:`get` reads one tensor
    and checks it is finite.
    """

    def __init__(self, model_dir: Path, layer: int):
        self.model_dir = Path(model_dir)
        self.layer = int(layer)
        if not self.model_dir.is_dir():
            raise QuantizeInputError(f"{self.model_dir}: checkpoint directory does not exist")
        weight_map, where = self._weight_map()
        self.templates, self.num_experts = self._layout(weight_map, where)
        names = [self.name(e, p) for e in range(self.num_experts) for p in PROJECTIONS]
        missing = [n for n in names if n not in weight_map]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise QuantizeInputError(f"layer {self.layer}: tensor {missing[0]} is missing from {where}{more}")
        self.files = {name: self.model_dir / weight_map[name] for name in names}
        headers = {path: read_safetensors_header(path) for path in sorted(set(self.files.values()))}
        self.specs: dict[str, tuple[str, tuple[int, ...]]] = {}
        for name, path in self.files.items():
            info = headers[path].get(name)
            if info is None:
                raise QuantizeInputError(
                    f"layer {self.layer}: tensor {name} is not in {path} (listed in {where})"
                )
            self.specs[name] = (info["dtype"], tuple(int(d) for d in info["shape"]))
        self._check_specs()
        self._handles: dict[Path, Any] = {}
        self._stack = contextlib.ExitStack()

    def _weight_map(self) -> tuple[dict[str, str], Path]:
        index = self.model_dir / INDEX_FILE
        if index.exists():
            data = _load_json(index, "safetensors index")
            weight_map = data.get("weight_map") if isinstance(data, dict) else None
            if not isinstance(weight_map, dict):
                raise QuantizeInputError(f"{index}: corrupt safetensors index (no weight_map)")
            return {str(k): str(v) for k, v in weight_map.items()}, index
        single = self.model_dir / SINGLE_FILE
        if single.exists():
            return dict.fromkeys(read_safetensors_header(single), SINGLE_FILE), single
        raise QuantizeInputError(f"{self.model_dir}: neither {INDEX_FILE} nor {SINGLE_FILE} found")

    def name(self, expert: int, proj: str) -> str:
        """The disk name of expert ``expert``'s ``proj`` weight in this checkpoint."""
        return self.templates[proj].format(layer=self.layer, expert=int(expert))

    def prefix(self, expert: int, proj: str) -> str:
        return self.name(expert, proj).removesuffix(".weight")

    def _layout(self, weight_map: Mapping[str, str], where: Path) -> tuple[dict[str, str], int]:
        """(expert name templates, expert count): the family's, from a config.json naming its model_type;
        else the qwen2_moe-style names and the count from config.json or the index."""
        config_path = self.model_dir / CONFIG_FILE
        config = _load_json(config_path, "model config") if config_path.exists() else None
        if isinstance(config, dict) and isinstance(config.get("model_type"), str):
            from mixquant.model.families import UnsupportedArchitecture, architecture

            try:
                arch = architecture(config)
            except UnsupportedArchitecture as exc:
                raise QuantizeInputError(f"{config_path}: {exc}") from exc
            if not 0 <= self.layer < arch.num_hidden_layers:
                raise QuantizeInputError(
                    f"layer {self.layer}: out of range, {config_path} has {arch.num_hidden_layers} layers"
                )
            if not arch.is_moe_layer(self.layer):
                raise QuantizeInputError(
                    f"layer {self.layer}: is a dense layer (no routed experts) per {config_path}"
                )
            return dict(arch.expert_templates), arch.num_experts
        return dict(_DEFAULT_TEMPLATES), self._num_experts(config, weight_map, where)

    def _num_experts(self, config: Any, weight_map: Mapping[str, str], where: Path) -> int:
        config_path = self.model_dir / CONFIG_FILE
        if config is not None:
            if isinstance(config, dict) and config.get("num_experts") is not None:
                if config.get("num_hidden_layers") is not None:
                    layers = int(config["num_hidden_layers"])
                    if not 0 <= self.layer < layers:
                        raise QuantizeInputError(
                            f"layer {self.layer}: out of range, {config_path} has {layers} layers"
                        )
                    try:
                        mlp_type = mlp_layer_types(config)[self.layer]
                    except ValueError as exc:
                        raise QuantizeInputError(f"{config_path}: {exc}") from exc
                    if mlp_type != "sparse":
                        raise QuantizeInputError(
                            f"layer {self.layer}: is a {mlp_type} layer (no routed experts) per {config_path}"
                        )
                return int(config["num_experts"])
        ids = set()
        for name in weight_map:
            match = _EXPERT_RE.match(name)
            if match and int(match.group(1)) == self.layer:
                ids.add(int(match.group(2)))
        if not ids:
            raise QuantizeInputError(f"layer {self.layer}: no routed-expert tensors in {where}")
        return max(ids) + 1

    def _check_specs(self) -> None:
        shapes: dict[str, tuple[int, ...]] = {}
        proj_of = {self.name(e, p): p for e in range(self.num_experts) for p in PROJECTIONS}
        for name, (dtype, shape) in self.specs.items():
            proj = proj_of[name]
            if dtype != "BF16":
                raise QuantizeInputError(
                    f"layer {self.layer}: tensor {name} has dtype {dtype} in {self.files[name]}, "
                    "expected BF16"
                )
            if len(shape) != 2:
                raise QuantizeInputError(
                    f"layer {self.layer}: tensor {name} has shape {list(shape)}, not 2-D"
                )
            want = shapes.setdefault(proj, shape)
            if shape != want:
                raise QuantizeInputError(
                    f"layer {self.layer}: tensor {name} has shape {list(shape)}, other experts' {proj} "
                    f"{list(want)}"
                )
        gate, up, down = (shapes[p] for p in PROJECTIONS)
        if up != gate or down != gate[::-1]:
            raise QuantizeInputError(
                f"layer {self.layer}: inconsistent expert shapes gate {list(gate)}, up {list(up)}, "
                f"down {list(down)} (expected [I, H], [I, H], [H, I])"
            )
        self.shapes = shapes

    def __enter__(self) -> _LayerSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()

    def get(self, name: str) -> torch.Tensor:
        """Read one tensor (bf16) from its shard; finite check."""
        path = self.files[name]
        try:
            handle = self._handles.get(path)
            if handle is None:
                handle = self._stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
                self._handles[path] = handle
            tensor = handle.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
            detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise QuantizeInputError(f"{path}: cannot read {name} (corrupt shard: {detail})") from exc
        if tensor.dtype != torch.bfloat16 or tuple(tensor.shape) != self.specs[name][1]:
            raise QuantizeInputError(f"{path}: {name} reads back as {tensor.dtype} {list(tensor.shape)}")
        if not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            kind = "NaN" if bool(torch.isnan(tensor).any()) else "Inf"
            raise QuantizeInputError(
                f"layer {self.layer}: tensor {name} has {bad} non-finite value(s) ({kind}) in {path}"
            )
        return tensor

    def experts(self) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """``(expert, {proj: bf16 weight})`` one expert at a time."""
        for e in range(self.num_experts):
            yield e, {p: self.get(self.name(e, p)) for p in PROJECTIONS}


def read_layer_experts(model_dir: Path, layer: int) -> dict[str, torch.Tensor]:
    """All routed-expert weights of ``layer`` (upstream names, bf16), read from the shards that hold them.

    Only the needed shards are opened, and only these tensors are read (``safe_open``). Raises
    :class:`QuantizeInputError` for a missing tensor, a non-bf16 or misshapen one, NaN/Inf values, or a
    truncated / corrupt shard (file size is checked against the header's declared data first).
    """
    with _LayerSource(model_dir, layer) as source:
        return {name: source.get(name) for name in source.files}


# ----------------------------------------------------------------------------------------- numerics


@torch.no_grad()
def nvfp4_mse_block_amax(
    weight: torch.Tensor, global_amax: torch.Tensor, *, chunk_blocks: int = _MSE_CHUNK_BLOCKS
) -> torch.Tensor:
    """Per-block amax of ModelOpt's NVFP4 ``mse`` (multiplier search, no ``fp8_scale_sweep``), fp32 [B, 1].

    Exactly ``_make_weight_mse_calibrator`` without the sweep: ModelOpt's own ``MseCalibrator``
    (``axis=(0,)`` over the ``[n_blocks, 16]`` calibration layout, ``MseCalibConfig`` defaults) started
    from the max-calibrated per-block amax, with the static NVFP4 fake quant at fixed ``global_amax`` as
    ``quant_func`` (ModelOpt's export numerics, as :func:`cpu_nvfp4_fake_quant` patches in). Blocks are
    independent (per-block loss and argmin), so processing ``chunk_blocks`` at a time is exact.
    """
    from modelopt.torch.quantization.calib.mse import MseCalibrator
    from modelopt.torch.quantization.config import MseCalibConfig

    from mixquant.formats.cpu_fake_quant import nvfp4_static_qdq

    cfg = MseCalibConfig()
    blocks = weight.detach().reshape(-1, BLOCK_SIZE)
    global_amax = torch.as_tensor(global_amax, dtype=torch.float32, device=weight.device).reshape(())
    quant_func = partial(nvfp4_static_qdq, global_amax=global_amax)
    out = torch.empty(blocks.shape[0], 1, dtype=torch.float32, device=weight.device)
    for b0 in range(0, blocks.shape[0], max(1, int(chunk_blocks))):
        chunk = blocks[b0 : b0 + chunk_blocks]
        # MaxCalibrator's per-block amax (in the weight dtype, then kept in fp32 by the static quantizer)
        initial = chunk.abs().amax(dim=1, keepdim=True).to(torch.float32)
        calibrator = MseCalibrator(
            amax=initial,
            axis=(0,),
            step_size=cfg.step_size,
            start_multiplier=cfg.start_multiplier,
            stop_multiplier=cfg.stop_multiplier,
            quant_func=quant_func,
        )
        calibrator.collect(chunk)  # casts to fp32, as ModelOpt's calibration forward does
        out[b0 : b0 + chunk.shape[0]] = calibrator.compute_amax().to(torch.float32).view(-1, 1)
        calibrator.reset()
    return out


def nvfp4_block_amax(weight: torch.Tensor, global_amax: torch.Tensor, calibration: str) -> torch.Tensor:
    """Per-block fp32 amax ``[n_blocks, 1]`` of a static NVFP4 weight quantizer for ``calibration``."""
    if calibration == "fp8_sweep":
        from mixquant.formats.nvfp4 import sweep_nvfp4_block_amax

        return sweep_nvfp4_block_amax(weight, global_amax)
    if calibration == "max":
        return weight.detach().reshape(-1, BLOCK_SIZE).abs().amax(dim=1, keepdim=True).to(torch.float32)
    if calibration == "mse":
        return nvfp4_mse_block_amax(weight, global_amax)
    raise ValueError(f"unknown NVFP4 calibration {calibration!r}; one of {NVFP4_CALIBRATIONS}")


def dequantize_tensors(
    tensors: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    """``{weight name: dequantized weight}`` for every ``*.weight`` in ``tensors`` (exported layout).

    ModelOpt's own dequantization, computed in fp32 and then cast to ``dtype``:

    * NVFP4 (uint8 ``weight`` + ``weight_scale`` + ``weight_scale_2``): ``NVFP4QTensor.dequantize``;
    * FP8 (float8_e4m3fn ``weight`` + ``weight_scale``): ``FP8QTensor.dequantize`` (``fp8 * scale``);
    * anything else: the weight itself (bf16 passthrough), cast to ``dtype``.

    ModelOpt is imported only when a quantized weight is met (a BF16 layer needs none of it).
    """
    out: dict[str, torch.Tensor] = {}
    for name, weight in tensors.items():
        if not name.endswith(_WEIGHT_SUFFIX):
            continue
        base = name[: -len(_WEIGHT_SUFFIX)]
        scale = tensors.get(f"{base}.weight_scale")
        if weight.dtype == torch.uint8 and scale is not None and f"{base}.weight_scale_2" in tensors:
            from modelopt.torch.quantization.qtensor import NVFP4QTensor

            shape = (*weight.shape[:-1], weight.shape[-1] * 2)
            qtensor = NVFP4QTensor(torch.Size(shape), torch.float32, weight)
            deq = qtensor.dequantize(
                dtype=torch.float32,
                scale=scale,
                double_scale=tensors[f"{base}.weight_scale_2"],
                block_sizes={-1: BLOCK_SIZE},
            )
        elif weight.dtype == torch.float8_e4m3fn and scale is not None:
            from modelopt.torch.quantization.qtensor import FP8QTensor

            deq = FP8QTensor(weight.shape, torch.float32, weight).dequantize(dtype=torch.float32, scale=scale)
        else:
            deq = weight
        out[name] = deq.to(dtype)
    return out


# ----------------------------------------------------------------------------------------- quantizing


def _validate_params(layer: int, fmt: str, params: Mapping[str, Any] | None) -> dict[str, Any]:
    if fmt not in FORMATS:
        raise QuantizeInputError(f"layer {layer}: format must be one of {FORMATS}, got {fmt!r}")
    params = dict(params or {})
    unknown = sorted(set(params) - _PARAM_KEYS[fmt])
    if unknown:
        known = sorted(_PARAM_KEYS[fmt])
        raise QuantizeInputError(f"layer {layer}: unknown {fmt} params {unknown}; known {known}")
    if fmt == NVFP4 and params.get("calibration") not in NVFP4_CALIBRATIONS:
        raise QuantizeInputError(
            f"layer {layer}: nvfp4_w4a16 params need calibration in {NVFP4_CALIBRATIONS}, "
            f"got {params.get('calibration')!r}"
        )
    if fmt == FP8 and params.get("weight_calibration") not in FP8_WEIGHT_CALIBRATIONS:
        raise QuantizeInputError(
            f"layer {layer}: fp8 params need weight_calibration in {FP8_WEIGHT_CALIBRATIONS}, "
            f"got {params.get('weight_calibration')!r}"
        )
    return params


def _scalar_amax(layer: int, activation_amax: Mapping[str, Any], key: str) -> torch.Tensor:
    given = [k for k in _AMAX_KEYS[key] if activation_amax.get(k) is not None]
    if not given:
        raise QuantizeInputError(
            f"layer {layer}: fp8 needs activation_amax[{key!r}] (the layer's input amax)"
        )
    value = activation_amax[given[0]]
    try:
        amax = torch.as_tensor(value).detach().to("cpu", torch.float32)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise QuantizeInputError(f"layer {layer}: activation_amax[{key!r}] is not a number") from exc
    if amax.numel() != 1:
        raise QuantizeInputError(
            f"layer {layer}: activation_amax[{key!r}] must be a scalar (one value per layer), "
            f"got shape {list(amax.shape)}"
        )
    amax = amax.reshape(())
    if not bool(torch.isfinite(amax)) or float(amax) <= 0:
        raise QuantizeInputError(
            f"layer {layer}: activation_amax[{key!r}] = {float(amax)} is not finite and > 0"
        )
    return amax


def _unrouted(layer: int, activation_amax: Mapping[str, Any], num_experts: int) -> list[int] | None:
    counts = activation_amax.get("routed_tokens")
    if counts is None:
        return None
    counts = torch.as_tensor(counts).detach().reshape(-1)
    if counts.numel() != num_experts:
        raise QuantizeInputError(
            f"layer {layer}: activation_amax['routed_tokens'] has {counts.numel()} entries for "
            f"{num_experts} experts"
        )
    return [int(e) for e in (counts == 0).nonzero().flatten()]


def _stats(values: torch.Tensor) -> dict[str, float]:
    v = values.detach().to(torch.float64).reshape(-1)
    return {"min": float(v.min()), "max": float(v.max()), "mean": float(v.mean())}


class _ErrorTotals:
    """Running sums for the per-layer and per-projection error totals (float64)."""

    def __init__(self) -> None:
        self.sq_err = 0.0
        self.sq_ref = 0.0
        self.numel = 0
        self.max_rel = 0.0
        self.tensors = 0

    def add(self, sq_err: float, sq_ref: float, numel: int, rel: float) -> None:
        self.sq_err += sq_err
        self.sq_ref += sq_ref
        self.numel += numel
        self.max_rel = max(self.max_rel, rel)
        self.tensors += 1

    def summary(self) -> dict[str, Any]:
        return {
            "tensors": self.tensors,
            "mse": self.sq_err / self.numel if self.numel else 0.0,
            "relative_error": _relative(self.sq_err, self.sq_ref),
            "max_relative_error": self.max_rel,
        }


def _relative(sq_err: float, sq_ref: float) -> float:
    if sq_ref > 0:
        return math.sqrt(sq_err / sq_ref)
    return 0.0 if sq_err == 0 else math.inf


def _quantize_expert(
    prefixes: Mapping[str, str],
    weights: Mapping[str, torch.Tensor],
    fmt: str,
    params: Mapping[str, Any],
    input_scales: Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Exported tensors of one expert (natural name order); ``prefixes[proj]``: its disk names without
    ``.weight`` (ModelOpt's export writes the checkpoint's own names back)."""
    out: dict[str, torch.Tensor] = {}
    gate, up, down = (weights[p] for p in PROJECTIONS)
    if fmt == BF16:
        for proj in PROJECTIONS:
            out[f"{prefixes[proj]}.weight"] = weights[proj]
    elif fmt == NVFP4:
        # ModelOpt's NVFP4 numerics (a heavy import: only where NVFP4 is quantized)
        from mixquant.formats.nvfp4 import nvfp4_export_tensors, shared_global_amax

        g_gate_up = shared_global_amax(gate, up)  # one quantizer over the fused [2I, H] slice
        for proj, g in (("gate_proj", g_gate_up), ("up_proj", g_gate_up), ("down_proj", None)):
            w = weights[proj]
            g = shared_global_amax(w) if g is None else g
            packed, scale, scale_2 = nvfp4_export_tensors(w, nvfp4_block_amax(w, g, params["calibration"]), g)
            p = prefixes[proj]
            out[f"{p}.weight"], out[f"{p}.weight_scale"], out[f"{p}.weight_scale_2"] = packed, scale, scale_2
    else:
        amax_fn = fp8_mse_weight_amax if params["weight_calibration"] == "mse" else fp8_max_amax
        gate_up = torch.cat([gate, up])  # gate rows first, as gate_up_proj[e]
        amax_gate_up = amax_fn(gate_up)
        del gate_up
        for proj, amax, key in (
            ("gate_proj", amax_gate_up, "gate_up"),
            ("up_proj", amax_gate_up, "gate_up"),
            ("down_proj", amax_fn(down), "down"),
        ):
            weight, scale = fp8_export_tensors(weights[proj], amax)
            p = prefixes[proj]
            out[f"{p}.weight"], out[f"{p}.weight_scale"] = weight, scale
            out[f"{p}.input_scale"] = input_scales[key].clone()  # own storage per tensor (safetensors)
    return out


def _tensor_audit(
    fmt: str, source: torch.Tensor, exported: Mapping[str, torch.Tensor], base: str, dequantized: torch.Tensor
) -> tuple[dict[str, Any], tuple[float, float, int, float]]:
    ref = source.to(torch.float64)
    diff = ref - dequantized.to(torch.float64)
    sq_err, sq_ref = float(diff.square().sum()), float(ref.square().sum())
    rel = _relative(sq_err, sq_ref)
    entry: dict[str, Any] = {
        "format": fmt,
        "shape": list(source.shape),
        "dtype": str(exported[f"{base}.weight"].dtype).removeprefix("torch."),
        "exported": {
            name.removeprefix(base + "."): {
                "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape),
            }
            for name, t in exported.items()
            if name.startswith(base + ".")
        },
        "scales": {},
        "mse": sq_err / source.numel() if source.numel() else 0.0,
        "relative_error": rel,
    }
    for suffix in ("weight_scale", "weight_scale_2", "input_scale"):
        scale = exported.get(f"{base}.{suffix}")
        if scale is not None:
            entry["scales"][suffix] = _stats(scale.to(torch.float32))
    return entry, (sq_err, sq_ref, source.numel(), rel)


@torch.no_grad()
def quantize_layer(
    model_dir: Path,
    layer: int,
    fmt: str,
    params: dict,
    *,
    activation_amax: dict | None = None,
    progress: bool = False,
    device: str | torch.device = "cpu",
) -> tuple[dict[str, torch.Tensor], dict]:
    """Quantize the routed experts of one MoE ``layer`` of the upstream checkpoint at ``model_dir``.

    Args:
        fmt: ``"nvfp4_w4a16"`` (params ``{"calibration": "fp8_sweep" | "max" | "mse"}``), ``"fp8"``
            (params ``{"weight_calibration": "mse" | "max"}``) or ``"bf16"`` (params ``{}``).
        activation_amax: fp8 only (required there): ``{"gate_up": amax, "down": amax}`` -- the layer's
            input amax into gate/up and into down (fp32 scalars; ``gate_up_input_amax`` /
            ``down_input_amax`` are accepted spellings), applied to *every* expert as ModelOpt's one input
            quantizer per layer does; optional ``"routed_tokens"`` ([E] token counts) to report experts
            that were never routed (they get the same layer-shared input_scale).
        progress: show a per-expert progress bar (stderr).
        device: where the scale search and the export arithmetic run (each expert's weights are moved
            there; the exported tensors come back to the CPU). ModelOpt's export numerics on every
            device: the pure-torch formulas, never the CUDA fake-quant kernels.

    Returns:
        ``(tensors, audit)``: ``tensors`` under the exported names (``model.layers.L.mlp.experts.E.
        {gate,up,down}_proj.{weight, weight_scale, weight_scale_2 | input_scale}``), byte-identical to
        ModelOpt's HF export; ``audit`` a JSON-serialisable dict (per-tensor scale stats and errors of
        the dequantized weight vs the bf16 source, per-projection and per-layer totals).

    Experts are processed one at a time: only one expert's source weights and temporaries are alive
    besides the growing output. Raises :class:`QuantizeInputError` on bad input (see
    :func:`read_layer_experts`; NVFP4 additionally needs every input dim to be a multiple of 16).
    """
    from tqdm.auto import tqdm

    layer = int(layer)
    params = _validate_params(layer, fmt, params)
    activation_amax = dict(activation_amax or {})
    input_scales: dict[str, torch.Tensor] = {}
    input_amax: dict[str, torch.Tensor] = {}
    if fmt == FP8:
        input_amax = {key: _scalar_amax(layer, activation_amax, key) for key in _AMAX_KEYS}
        input_scales = {key: amax / FP8_E4M3_MAX for key, amax in input_amax.items()}  # fp32(amax) / 448
    with _LayerSource(model_dir, layer) as source:
        if fmt == NVFP4:
            for proj in PROJECTIONS:
                k = source.shapes[proj][-1]
                if k % BLOCK_SIZE:
                    name = source.name(0, proj)
                    raise QuantizeInputError(
                        f"layer {layer}: tensor {name} (and every expert's {proj}) has input dim {k}, "
                        f"not a multiple of the NVFP4 block size {BLOCK_SIZE}"
                    )
        unrouted = _unrouted(layer, activation_amax, source.num_experts) if fmt == FP8 else None
        tensors: dict[str, torch.Tensor] = {}
        per_tensor: dict[str, Any] = {}
        totals = _ErrorTotals()
        per_proj = {p: _ErrorTotals() for p in PROJECTIONS}
        source_bytes = 0
        bar = tqdm(total=source.num_experts, desc=f"layer {layer} {fmt}", disable=not progress, leave=False)
        device = torch.device(device)
        input_scales = {key: scale.to(device) for key, scale in input_scales.items()}
        for e, weights in source.experts():
            weights = {proj: weight.to(device) for proj, weight in weights.items()}
            prefixes = {proj: source.prefix(e, proj) for proj in PROJECTIONS}
            exported = _quantize_expert(prefixes, weights, fmt, params, input_scales)
            dequantized = dequantize_tensors(exported)
            for proj in PROJECTIONS:
                base = prefixes[proj]
                entry, (sq_err, sq_ref, numel, rel) = _tensor_audit(
                    fmt, weights[proj], exported, base, dequantized[f"{base}.weight"]
                )
                per_tensor[f"{base}.weight"] = entry
                totals.add(sq_err, sq_ref, numel, rel)
                per_proj[proj].add(sq_err, sq_ref, numel, rel)
                source_bytes += weights[proj].numel() * weights[proj].element_size()
            del dequantized
            tensors.update({name: tensor.cpu() for name, tensor in exported.items()})
            bar.update(1)
        bar.close()

    exported_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    audit: dict[str, Any] = {
        "layer": layer,
        "format": fmt,
        "params": params,
        "num_experts": source.num_experts,
        "expert_shapes": {p: list(s) for p, s in source.shapes.items()},
        "totals": {
            **totals.summary(),
            "exported_tensors": len(tensors),
            "source_bytes": source_bytes,
            "exported_bytes": exported_bytes,
            "scales": _scale_totals(per_tensor),
            "projections": {p: t.summary() for p, t in per_proj.items()},
        },
        "tensors": per_tensor,
    }
    if fmt == FP8:
        audit["input_scale_source"] = INPUT_SCALE_SOURCE
        audit["input_amax"] = {k: float(v) for k, v in input_amax.items()}
        audit["input_scale"] = {k: float(v) for k, v in input_scales.items()}
        audit["unrouted_experts"] = None if unrouted is None else len(unrouted)
        audit["unrouted_expert_ids"] = unrouted
    return tensors, audit


def _scale_totals(per_tensor: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """Layer-wide min / max / mean-of-means of each scale kind over all tensors."""
    out: dict[str, dict[str, float]] = {}
    for entry in per_tensor.values():
        for kind, s in entry["scales"].items():
            agg = out.setdefault(kind, {"min": math.inf, "max": -math.inf, "mean": 0.0, "_n": 0})
            agg["min"], agg["max"] = min(agg["min"], s["min"]), max(agg["max"], s["max"])
            agg["mean"] += s["mean"]
            agg["_n"] += 1
    for agg in out.values():
        agg["mean"] /= agg.pop("_n")
    return out


def save_layer_result(tensors: Mapping[str, torch.Tensor], audit: Mapping[str, Any], out_dir: Path) -> None:
    """Write ``out_dir/layer.safetensors`` (natural name order, ``{"format": "pt"}``) and ``audit.json``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    payload: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name in sorted(tensors, key=natural_key):
        tensor = tensors[name].detach().to("cpu").contiguous()
        if tensor.untyped_storage().data_ptr() in seen:  # safetensors refuses tensors sharing storage
            tensor = tensor.clone()
        seen.add(tensor.untyped_storage().data_ptr())
        payload[name] = tensor
    save_file(payload, str(out_dir / LAYER_FILE), metadata=dict(SAFETENSORS_METADATA))
    (out_dir / AUDIT_FILE).write_text(json.dumps(audit, indent=2, sort_keys=True) + "\n", encoding="utf-8")
