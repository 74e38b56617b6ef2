"""ModelOpt *reference* quantization of an MoE model (Laguna and the other families of
mixquant.model.families) to a per-layer placement of routed-expert formats.

This is the slow, whole-model path that a streaming per-layer implementation must reproduce bit for bit:
load the BF16 model, ``mtq.quantize`` it with a placement-specific ``quant_cfg`` and a forward loop over
the calibration tokens, then ``modelopt.torch.export.export_hf_checkpoint``. Everything numerical is
ModelOpt 0.47's own code (on a machine without CUDA the two NVFP4 fake-quant call sites are replaced by
bit-exact pure-torch equivalents, :mod:`mixquant.formats.cpu_fake_quant`).

How ModelOpt 0.47 handles Laguna's routed experts (line numbers: modelopt 0.47.0):

* transformers 5 keeps routed experts fused (``LagunaExperts``: ``gate_up_proj`` [E, 2I, H], ``down_proj``
  [E, H, I]); ModelOpt's ``register_fused_experts_on_the_fly`` (``plugins/huggingface.py:1707``) wraps
  the class with ``_QuantFusedExperts`` (``:986``), which intercepts the two ``F.linear`` calls per expert.
  ``force_eager_experts_impl_on_the_fly`` (``:1735``) pins ``config._experts_implementation = "eager"``.
  ``LagunaSparseMoeBlock`` is *not* wrapped (``_is_sparse_sequaential_moe_block`` needs iterable
  experts, ``:1616``), so there is no forced all-expert routing (``moe_calib_experts_ratio`` is a no-op).
* Quantizers per MoE layer L (module ``model.layers.L.mlp.experts``): ``gate_up_proj_weight_quantizers.{e}``
  and ``down_proj_weight_quantizers.{e}`` (one per expert, over the expert's *fused* [2I, H] gate+up slice
  and its [H, I] down slice), and ONE ``gate_up_proj_input_quantizer`` and ONE ``down_proj_input_quantizer``
  shared by all experts of the layer. ``quant_cfg`` wildcards see the per-expert names with the index
  stripped (``..._weight_quantizers.3`` -> ``..._weight_quantizer``, ``conversion.py:322``).
* Weight quantizers of every expert are calibrated from the weight itself (``weight_only_quantize`` in
  ``max_calibrate``, ``model_calib.py:352``), whether or not tokens reach the expert. Input quantizers
  collect max |x| over exactly the tokens routed (top-k) to any expert of the layer, from the
  *unquantized* model (calibration disables fake quant, ``model_calib.py:1128``).
* Export (``export/moe_utils.py:48``) splits each expert into ``experts.{e}.{gate,up,down}_proj``; gate and
  up are exported from deep copies of the same fused quantizer (so they share ``weight_scale_2`` for NVFP4
  and ``weight_scale`` for FP8), and both get the layer's shared ``input_scale``.

See :func:`modelopt_calibration_plan` for how the per-format calibration algorithms map onto ModelOpt.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from mixquant.formats.facts import BF16, FORMATS, FP8, NVFP4
from mixquant.model.families import architecture, experts_module_name

__all__ = [
    "BF16",
    "FORMATS",
    "FP8",
    "FP8_WEIGHT_ALGORITHMS",
    "NVFP4",
    "NVFP4_ALGORITHMS",
    "CalibrationPlan",
    "expert_quantizer_pattern",
    "modelopt_calibration_plan",
    "modelopt_placement_quant_cfg",
    "modelopt_reference_export",
]

NVFP4_ALGORITHMS = ("fp8_sweep", "mse", "max")
FP8_WEIGHT_ALGORITHMS = ("mse", "max")

# ModelOpt calibration algorithm configs, and what each does to the two weight formats.
# With fp8_scale_sweep=True, mse_calibrate only refines static-NVFP4 weight quantizers; plain FP8 weights
# keep their max-calibrated amax (_make_weight_mse_calibrator, model_calib.py:708-718).
_ALGO_MAX = "max"
_ALGO_MSE: dict[str, Any] = {"method": "mse"}
_ALGO_FP8_SWEEP: dict[str, Any] = {"method": "mse", "fp8_scale_sweep": True}
_ALGORITHMS: dict[str, tuple[Any, dict[str, str]]] = {
    # name: (mtq algorithm, {format: weight algorithm it applies})
    "max": (_ALGO_MAX, {NVFP4: "max", FP8: "max"}),
    "mse": (_ALGO_MSE, {NVFP4: "mse", FP8: "mse"}),
    "fp8_sweep": (_ALGO_FP8_SWEEP, {NVFP4: "fp8_sweep", FP8: "max"}),
}


@dataclass(frozen=True)
class CalibrationPlan:
    """How a requested (NVFP4, FP8-weight) algorithm pair is realised with ModelOpt.

    ``algorithm`` is passed to ``mtq.quantize``. ``refine`` lists formats whose expert weight quantizers
    are afterwards re-fitted by ModelOpt's own MSE weight search (``model_calib._mse_calibrate_weights``,
    restricted to that format's ``mlp.experts`` modules) with the given ``mse_calibrate`` keyword
    arguments; empty when one ``mtq.quantize`` call does exactly what was requested.
    """

    algorithm: Any
    refine: dict[str, dict[str, Any]] = field(default_factory=dict)
    note: str = ""


def _mse_defaults() -> dict[str, Any]:
    from modelopt.torch.quantization.config import MseCalibConfig

    cfg = MseCalibConfig()
    return {
        "step_size": cfg.step_size,
        "start_multiplier": cfg.start_multiplier,
        "stop_multiplier": cfg.stop_multiplier,
    }


def modelopt_calibration_plan(
    nvfp4_algorithm: str, fp8_weight_algorithm: str, formats: tuple[str, ...] | set[str] = (NVFP4, FP8)
) -> CalibrationPlan:
    """Translate per-format weight algorithms into ModelOpt calibration (one call, or one call + refine).

    ModelOpt 0.47 applies ONE calibration algorithm per ``mtq.quantize`` call to every quantizer
    (``QuantizeConfig.algorithm``; a list of algorithms would re-run ``max_calibrate`` each time). What
    each algorithm does to the two weight formats of this project:

    ==============================================  ================  =====================
    mtq algorithm                                   NVFP4 (static)    FP8 per-tensor weight
    ==============================================  ================  =====================
    ``"max"``                                       max (per block)   max
    ``{"method": "mse"}``                           mse multipliers   mse multipliers
    ``{"method": "mse", "fp8_scale_sweep": True}``  FP8-code sweep    max (skipped)
    ==============================================  ================  =====================

    So (fp8_sweep, max), (mse, mse) and (max, max) are single calls. The other pairs cannot be expressed
    in one call; the closest faithful realisation used here is: the single call that gives NVFP4 what was
    asked, then ModelOpt's own weight MSE search on the FP8 experts only -- (fp8_sweep, mse) and
    (max, mse); for (mse, max) the call is ``"max"`` followed by the MSE search on the NVFP4 experts only.
    This is *exactly* what a per-format algorithm would give, because (a) ``mse_calibrate`` is
    ``max_calibrate`` followed by a weight-only search that starts from the max-calibrated amax
    (``model_calib.py:733``), (b) the weight search depends on nothing but the weight and (c) activation
    amaxes are collected with fake quant disabled, so no weight algorithm can influence them.

    ``formats`` restricts the decision to formats actually present (an absent format imposes nothing).
    """
    if nvfp4_algorithm not in NVFP4_ALGORITHMS:
        raise ValueError(f"nvfp4_algorithm must be one of {NVFP4_ALGORITHMS}, got {nvfp4_algorithm!r}")
    if fp8_weight_algorithm not in FP8_WEIGHT_ALGORITHMS:
        raise ValueError(
            f"fp8_weight_algorithm must be one of {FP8_WEIGHT_ALGORITHMS}, got {fp8_weight_algorithm!r}"
        )
    want = {NVFP4: nvfp4_algorithm, FP8: fp8_weight_algorithm}
    want = {fmt: algo for fmt, algo in want.items() if fmt in formats}
    if not want:
        return CalibrationPlan(copy.deepcopy(_ALGO_MAX), note="no quantized experts")
    for name, (algorithm, effect) in _ALGORITHMS.items():
        if all(effect[fmt] == algo for fmt, algo in want.items()):
            return CalibrationPlan(copy.deepcopy(algorithm), note=f"single mtq.quantize call ({name})")
    # Only pairs with one format needing the multiplier MSE remain (the other gets max or the sweep).
    mse = _mse_defaults()
    if want[NVFP4] == "mse":  # (mse, max): max for both, then MSE on the NVFP4 experts
        return CalibrationPlan(
            copy.deepcopy(_ALGO_MAX),
            {NVFP4: {**mse, "fp8_scale_sweep": False}},
            note="mtq.quantize(max) + ModelOpt weight MSE (multipliers) on the NVFP4 experts",
        )
    base = "fp8_sweep" if want[NVFP4] == "fp8_sweep" else "max"  # (fp8_sweep, mse) or (max, mse)
    return CalibrationPlan(
        copy.deepcopy(_ALGORITHMS[base][0]),
        {FP8: {**mse, "fp8_scale_sweep": False}},
        note=f"mtq.quantize({base}) + ModelOpt weight MSE (multipliers) on the FP8 experts",
    )


def expert_quantizer_pattern(layer: int, kind: str) -> str:
    """``quant_cfg`` wildcard for the routed-expert ``kind`` ("weight"/"input") quantizers of one layer.

    Matches (after ModelOpt strips the per-expert index) ``model.layers.L.mlp.experts.
    {gate_up_proj,down_proj}_{kind}_quantizer``; never the shared expert (``mlp.shared_experts``) nor
    layer ``L0`` for ``L0 != L`` (``layers.1.`` does not match ``layers.11.``).
    """
    if kind not in ("weight", "input"):
        raise ValueError(f"kind must be 'weight' or 'input', got {kind!r}")
    return f"{experts_module_name(layer)}.*{kind}_quantizer"


def _preset_quantizer_cfg(preset: Mapping[str, Any], quantizer_name: str) -> dict[str, Any]:
    for entry in preset["quant_cfg"]:
        if entry.get("quantizer_name") == quantizer_name and "cfg" in entry:
            return copy.deepcopy(entry["cfg"])
    raise KeyError(f"preset has no cfg entry for {quantizer_name!r}")


def _validate_placement(placement: Mapping[int, str]) -> dict[int, str]:
    out: dict[int, str] = {}
    for layer, fmt in placement.items():
        if fmt not in FORMATS:
            raise ValueError(f"layer {layer}: format must be one of {FORMATS}, got {fmt!r}")
        out[int(layer)] = fmt
    return dict(sorted(out.items()))


def modelopt_placement_quant_cfg(
    placement: dict[int, str], *, nvfp4_algorithm: str, fp8_weight_algorithm: str
) -> tuple[dict, dict | str]:
    """``(quant_cfg, algorithm)`` for ``mtq.quantize`` realising ``placement`` (MoE layer -> format).

    ``quant_cfg`` is ``{"quant_cfg": [...], "algorithm": algorithm}``: everything disabled, then per layer

    * ``nvfp4_w4a16``: the ``W4A16_NVFP4_CFG`` weight quantizer (E2M1 values, E4M3 scales per 16-element
      block) with *static* block scales (so ``fp8_scale_sweep`` applies); input quantizers stay disabled;
    * ``fp8``: ``FP8_DEFAULT_CFG``'s per-tensor E4M3 weight and static per-tensor E4M3 input quantizers;
    * ``bf16`` (or absent): nothing enabled.

    Only routed experts of the named layers are touched; attention, shared expert, router, dense layer 0,
    lm_head and embeddings stay BF16. ``algorithm`` is :func:`modelopt_calibration_plan`'s ``mtq.quantize``
    algorithm; when the plan also needs a refine pass (see there), :func:`modelopt_reference_export` runs
    it -- this function alone then realises only the single-call part.
    """
    import modelopt.torch.quantization as mtq

    from mixquant.formats.nvfp4 import nvfp4_w4a16_static_config  # lazy: imports modelopt

    placement = _validate_placement(placement)
    plan = modelopt_calibration_plan(nvfp4_algorithm, fp8_weight_algorithm, set(placement.values()))
    nvfp4_weight = _preset_quantizer_cfg(nvfp4_w4a16_static_config("max"), "*weight_quantizer")
    fp8_weight = _preset_quantizer_cfg(mtq.FP8_DEFAULT_CFG, "*weight_quantizer")
    fp8_input = _preset_quantizer_cfg(mtq.FP8_DEFAULT_CFG, "*input_quantizer")
    entries: list[dict[str, Any]] = [{"quantizer_name": "*", "enable": False}]
    for layer, fmt in placement.items():
        if fmt == NVFP4:
            entries.append(
                {
                    "quantizer_name": expert_quantizer_pattern(layer, "weight"),
                    "cfg": copy.deepcopy(nvfp4_weight),
                }
            )
        elif fmt == FP8:
            entries.append(
                {
                    "quantizer_name": expert_quantizer_pattern(layer, "weight"),
                    "cfg": copy.deepcopy(fp8_weight),
                }
            )
            entries.append(
                {"quantizer_name": expert_quantizer_pattern(layer, "input"), "cfg": copy.deepcopy(fp8_input)}
            )
    algorithm = copy.deepcopy(plan.algorithm)
    return {"quant_cfg": entries, "algorithm": copy.deepcopy(algorithm)}, algorithm


def _refine_weights(model: torch.nn.Module, placement: Mapping[int, str], plan: CalibrationPlan) -> list:
    """Run ModelOpt's weight MSE search on the ``mlp.experts`` modules of the formats in ``plan.refine``."""
    from modelopt.torch.quantization.model_calib import _mse_calibrate_weights

    done = []
    for fmt, kwargs in plan.refine.items():
        names = {experts_module_name(layer) for layer, f in placement.items() if f == fmt}
        name_to_module = {n: m for n, m in model.named_modules() if n in names}
        if not name_to_module:
            continue
        _mse_calibrate_weights(model, name_to_module, **kwargs)
        done.append({"format": fmt, "modules": sorted(name_to_module), "mse_calibrate_weights": kwargs})
    return done


def _calibration_forward_loop(calibration_ids: torch.Tensor, batch_size: int):
    ids = calibration_ids.detach().to(torch.long)
    if ids.dim() != 2:
        raise ValueError(f"calibration_ids must be [num_sequences, seq_len], got {tuple(ids.shape)}")

    def forward_loop(model: torch.nn.Module) -> None:
        device = next(model.parameters()).device
        for start in range(0, ids.shape[0], batch_size):
            model(input_ids=ids[start : start + batch_size].to(device), use_cache=False)

    return forward_loop


def _exported_tensor_names(out_dir: Path) -> list[str]:
    index = out_dir / "model.safetensors.index.json"
    if index.exists():
        return sorted(json.loads(index.read_text())["weight_map"])
    names: list[str] = []
    for shard in sorted(out_dir.glob("*.safetensors")):
        with safe_open(shard, "pt") as handle:
            names.extend(handle.keys())
    return sorted(names)


def _group_names(names: list[str], placement: Mapping[int, str], arch: Any) -> dict[str, list[str]]:
    """Exported tensor names by the format of the routed-expert layer they belong to ("other" if none)."""
    groups: dict[str, list[str]] = {fmt: [] for fmt in FORMATS}
    groups["other"] = []
    for name in names:
        routed = arch.routed_expert_of(name)
        if routed is not None:
            groups[placement.get(routed[0], BF16)].append(name)
        else:
            groups["other"].append(name)
    return groups


def modelopt_reference_export(
    model_dir: Path,
    calibration_ids: torch.Tensor,
    placement: dict[int, str],
    out_dir: Path,
    *,
    nvfp4_algorithm: str = "fp8_sweep",
    fp8_weight_algorithm: str = "mse",
    batch_size: int = 8,
) -> dict:
    """Quantize the BF16 MoE checkpoint in ``model_dir`` to ``placement`` with ModelOpt and export it.

    Loads the checkpoint's transformers class (``AutoModelForCausalLM``, any supported family) in bf16,
    runs ``mtq.quantize`` with :func:`modelopt_placement_quant_cfg`
    and a forward loop over ``calibration_ids`` (``[N, T]`` token ids, ``batch_size`` sequences per forward,
    no attention mask), runs the refine pass of :func:`modelopt_calibration_plan` if any, then
    ``export_hf_checkpoint(model, export_dir=out_dir)``. Layers absent from ``placement`` stay BF16.

    Returns a JSON-serialisable summary: versions, placement, algorithms (requested and realised), the
    ``quant_cfg`` used, the exported tensor names grouped by format, and the ``hf_quant_config.json``.
    """
    import modelopt
    import modelopt.torch.quantization as mtq
    import transformers
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM

    from mixquant.formats.cpu_fake_quant import cpu_nvfp4_fake_quant  # lazy: imports modelopt

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    placement = _validate_placement(placement)
    plan = modelopt_calibration_plan(nvfp4_algorithm, fp8_weight_algorithm, set(placement.values()))
    quant_cfg, algorithm = modelopt_placement_quant_cfg(
        placement, nvfp4_algorithm=nvfp4_algorithm, fp8_weight_algorithm=fp8_weight_algorithm
    )

    # ModelOpt forces eager experts anyway (force_eager_experts_impl_on_the_fly); the default on load
    # is grouped_mm, whose bf16 results differ, so ask for eager up front to make that explicit.
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, experts_implementation="eager"
    )
    model.eval()
    arch = architecture(model_dir)
    sparse = list(arch.moe_layers)
    not_moe = sorted(set(placement) - set(sparse))
    if not_moe:
        raise ValueError(f"placement names layers without routed experts: {not_moe} (MoE layers: {sparse})")

    with cpu_nvfp4_fake_quant() as cpu_patch, torch.no_grad():
        mtq.quantize(
            model,
            copy.deepcopy(quant_cfg),
            forward_loop=_calibration_forward_loop(calibration_ids, batch_size),
        )
        refined = _refine_weights(model, placement, plan)
        out_dir.mkdir(parents=True, exist_ok=True)
        export_hf_checkpoint(model, export_dir=out_dir)

    names = _exported_tensor_names(out_dir)
    hf_quant_config_path = out_dir / "hf_quant_config.json"
    hf_quant_config = json.loads(hf_quant_config_path.read_text()) if hf_quant_config_path.exists() else None
    return {
        "modelopt_version": modelopt.__version__,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "cpu_nvfp4_fake_quant": bool(cpu_patch),
        "placement": {str(k): v for k, v in placement.items()},
        "nvfp4_algorithm": nvfp4_algorithm,
        "fp8_weight_algorithm": fp8_weight_algorithm,
        "algorithm": algorithm,
        "refine": refined,
        "plan_note": plan.note,
        "quant_cfg": json.loads(json.dumps(quant_cfg)),
        "batch_size": batch_size,
        "calibration_shape": list(calibration_ids.shape),
        "tensors": _group_names(names, placement, arch),
        "hf_quant_config": hf_quant_config,
        "files": sorted(p.name for p in out_dir.iterdir() if p.is_file()),
    }
