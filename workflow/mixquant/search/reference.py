"""ModelOpt *reference* KL sensitivity scores: ``mtq.auto_quantize(method="kl_div")`` on the routed experts.

mixquant's own scorer (:mod:`mixquant.search.score`) must reproduce these numbers; this module runs
ModelOpt 0.47's search itself (on CPU with :mod:`mixquant.formats.cpu_fake_quant`) and reads the scores
back out of it. How ModelOpt computes them (``modelopt/torch/quantization/algorithms.py``, 0.47.0):

* **Groups.** Every fused-experts module ``model.layers.L.mlp.experts`` (``_QuantFusedExperts``) is one
  auto-quantize module and, since no ``quant_grouping_rules`` entry matches a name without an expert
  index, its own group: one ``QuantRecipeHparam`` named ``model.layers.L.mlp.experts.quant_recipe``,
  scored at the experts module itself (``score_modules[0]``). Its choices are the given presets plus the
  implicit no-quant recipe (``QuantRecipe(None)``, our ``bf16``), sorted by ``(compression, signature)``:
  NVFP4 W4A16 (4.5 effective bits), FP8 (8), no-quant (16).
* **Restriction.** ``auto_quantize``'s own ``disabled_layers`` (fnmatch patterns on module names): a group
  with any disabled member gets the single choice no-quant and is not configurable, so it is never scored
  (``insert_hparams_after_merge_rules``). Patterns cannot express "everything except", so we pass the exact
  names of all modules that own parameters (every auto-quantize module -- quantized Linear/Conv or fused
  experts -- does) other than the target experts. Disabled groups still sit in ``candidate_stats`` and, by
  default, in the cost denominator of the effective-bits constraint (at 16 bits).
* **Budget.** With a ``cost_model`` the same exact names go to the constraint's
  ``cost.excluded_module_name_patterns`` (``_auto_quantize_cost.py``: a group all of whose modules match
  costs 0), so the denominator is the target experts alone -- mixquant's routed effective bits. ``numel``
  maps to ModelOpt's ``"weight"`` cost model, ``active_moe`` to ``"active_moe"`` with mixquant's
  ``top_k / num_experts`` as ``active_moe_expert_ratio`` (the shipped recipe
  ``general/auto_quantize/w4a16_nvfp4_fp8_at_6p0bits-active_moe.yaml`` sets it the same way).
* **Calibration** (``before_search``): per preset, every group is switched to that preset at once
  (``set_calibration_recipe``) and ``calibrate(algorithm="max")`` runs ``num_calib_steps`` batches.
  Calibration forwards run with fake quantization *disabled* (``enable_stats_collection`` calls
  ``disable_quant``), so each layer's FP8 input amax comes from the unquantized model, exactly as a
  single-layer ``mtq.quantize`` would give it; weight amaxes come from the weights.
* **Scores** (``AutoQuantizeKLDivSearcher.estimate_sensitivity_scores``, under ``torch.inference_mode``):
  per score batch, one forward with every group at no-quant gives ``log_p = log_softmax(logits.float())``;
  then for each group and each non-no-quant recipe, that group alone is switched to the recipe (all others
  stay no-quant) and ``F.kl_div(log_softmax(logits_q.float()), log_p, reduction="sum", log_target=True)``
  -- i.e. ``KL(P_unquant || Q_quant)`` summed over every position of the batch (no mask, no shift) --
  is added to ``hparam._importance_dict[recipe][score_module]``. That is a 0-d **float32** tensor (the first
  batch's tensor, then ``+=`` in place), so the sum over batches is accumulated in fp32.
  ``QuantRecipeHparam.get_score(recipe)`` sums ``.cpu().item()`` over score modules (here one) -> the raw
  score; no-quant has no importance entry and scores 0.
* **Clamp** (``initialize_candidate_stats``): along ``solver_choices`` (most compressed first) each score is
  replaced by ``min(score, previous)``, so ``candidate_stats[...]["scores"]`` for FP8 is
  ``min(fp8, nvfp4)`` and no-quant is 0. These clamped scores are what the minimax threshold search uses.
* Cost per choice: ``weight numel * compression`` (NVFP4: 4.5 / 16, FP8: 8 / 16, no-quant: 1).
* Candidate numerics are ModelOpt's *fake quant*, not its export arithmetic, and the two round differently
  at (near-)ties, so a scorer fed exported/dequantized tensors does not reproduce these scores (on the toy
  model: up to ~2e-2 relative for NVFP4, ~0.25 for FP8):

  - ``W4A16_NVFP4_CFG`` is *dynamic* NVFP4: per-expert amax (max-calibrated, kept in the weight dtype),
    ``scale_2 = amax / (6 * 448)``, block scale ``fp32(block_amax) / (6 * scale_2)`` cast to E4M3
    (``NVFP4QTensor.get_weights_scaling_factor``, which the CPU replacement calls; the GPU runs a Triton
    kernel instead). The static-quantizer export path computes ``(block_amax / 6) / (amax / 6) * 448``
    and picks the other E4M3 neighbour of some exact ties (e.g. 184 -> 176 instead of 192).
  - FP8 weights and inputs go through ``_fp8_eager`` (CPU): ``e4m3(x.float() * (448 / amax)) *
    (1 / (448 / amax))``, not export's ``e4m3(w / (amax / 448)) * (amax / 448)``.

  Weight amax per expert covers the fused ``gate_up_proj[e]`` slice resp. ``down_proj[e]``; the FP8 input
  amax is one per layer and projection (see :mod:`mixquant.quantize.reference`).
* ModelOpt pins ``config._experts_implementation = "eager"`` (``force_eager_experts_impl_on_the_fly``);
  other backends would bypass the ``F.linear`` hooks. We check it.
"""

from __future__ import annotations

import contextlib
import copy
import io
import math
import warnings
from collections.abc import Iterator
from typing import Any

import torch

warnings.filterwarnings("ignore", message="transformers .* is not tested")

import modelopt.torch.quantization as mtq  # noqa: E402

from mixquant.calibration.tokens import calibration_batches  # noqa: E402
from mixquant.formats.cpu_fake_quant import cpu_nvfp4_fake_quant  # noqa: E402
from mixquant.formats.facts import BF16, FP8, NVFP4  # noqa: E402
from mixquant.model.families import experts_module_name, moe_experts  # noqa: E402

__all__ = ["BF16", "MODELOPT_COST_MODELS", "MODELOPT_FORMATS", "modelopt_kl_div_scores"]

# ModelOpt's shipped presets (max calibration); deep-copied at use so ModelOpt's shared dicts stay intact.
MODELOPT_FORMATS: dict[str, dict[str, Any]] = {
    NVFP4: mtq.W4A16_NVFP4_CFG,
    FP8: mtq.FP8_DEFAULT_CFG,
}
# placement.cost_model -> ModelOpt 0.47's constraints["cost_model"]
MODELOPT_COST_MODELS = {"numel": "weight", "active_moe": "active_moe"}


@contextlib.contextmanager
def _quiet(enabled: bool) -> Iterator[None]:
    """Swallow stdout/stderr (ModelOpt prints, tqdm bars) and warnings when ``enabled``."""
    with contextlib.ExitStack() as stack:
        if enabled:
            stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
            stack.enter_context(contextlib.redirect_stderr(io.StringIO()))
            stack.enter_context(warnings.catch_warnings())
            warnings.simplefilter("ignore")
        yield


def _forward_step(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    device = next(model.parameters()).device
    return model(input_ids=batch.to(device), use_cache=False).logits


def modelopt_kl_div_scores(
    model: torch.nn.Module,
    calibration_ids: torch.Tensor,
    *,
    layers: list[int],
    formats: list[str],
    batch_size: int,
    effective_bits: float = 16.0,
    cost_model: str | None = None,
    active_moe_expert_ratio: float | None = None,
    in_place: bool = False,
    progress: bool = False,
) -> dict:
    """Run ``mtq.auto_quantize(method="kl_div")`` on a deep copy of ``model``, searching only the routed
    experts of ``layers`` over ``formats`` (+ implicit no-quant), and return its per-group scores.

    ``calibration_ids`` ([N, T] token ids) are cut into consecutive batches of ``batch_size`` rows (the last
    may be smaller); every batch is used both to calibrate (``num_calib_steps``) and to score
    (``num_score_steps``); ``forward_step`` is ``model(input_ids=batch, use_cache=False).logits``.
    Runs under ``torch.inference_mode`` and, without CUDA, the CPU NVFP4 fake quant. ``model`` is not
    modified (``in_place=True`` searches on ``model`` itself instead of a copy: it is left quantized).
    ``effective_bits`` is the constraint of ModelOpt's minimax placement (``selection``). With
    ``cost_model`` None ModelOpt's cost denominator counts every auto-quantize module of the model (disabled
    ones at 16); with ``"numel"`` or ``"active_moe"`` (``active_moe_expert_ratio`` required) only the
    target experts, as mixquant's budget does.

    Returns (layers as ``int``, formats as given plus ``"bf16"`` for no-quant)::

        {"scores": {layer: {fmt: float}},          # raw fp32-accumulated KL sums (before the clamp)
         "clamped_scores": {layer: {fmt: float}},  # candidate_stats scores: min(score, more compressed)
         "costs": {layer: {fmt: float}},           # weight numel * compression
         "selection": {layer: fmt},                # ModelOpt's minimax pick at effective_bits
         "selection_satisfied": bool,              # whether that pick meets the constraint
         "cost_denominator": float,                # uncompressed cost of every costed module
         "effective_bits": float,                  # ModelOpt's own effective bits of its selection
         "constraints": dict,                      # what auto_quantize was given
         "tokens": int, "batches": int, "modelopt_version": str}

    Raises ``RuntimeError`` when the searched groups are not exactly the experts of ``layers``, the
    experts implementation is not eager or (with a ``cost_model``) the cost denominator is not the experts'.
    """
    import modelopt
    from modelopt.torch.opt.utils import named_hparams
    from modelopt.torch.quantization.algorithms import QuantRecipe, QuantRecipeHparam

    unknown = sorted(set(formats) - set(MODELOPT_FORMATS))
    if unknown or not formats or len(set(formats)) != len(formats):
        raise ValueError(f"formats must be distinct names from {sorted(MODELOPT_FORMATS)}, got {formats}")
    layers = sorted({int(layer) for layer in layers})
    moe = sorted(moe_experts(model))
    if not layers or not set(layers) <= set(moe):
        raise ValueError(f"layers must be a non-empty subset of the MoE layers {moe}, got {layers}")
    batches = calibration_batches(calibration_ids, batch_size)
    if cost_model is not None and cost_model not in MODELOPT_COST_MODELS:
        raise ValueError(
            f"cost_model must be one of {sorted(MODELOPT_COST_MODELS)} or None, got {cost_model!r}"
        )
    if cost_model == "active_moe" and not (active_moe_expert_ratio and 0 < active_moe_expert_ratio <= 1):
        raise ValueError(
            f"cost_model active_moe needs active_moe_expert_ratio in (0, 1], got {active_moe_expert_ratio}"
        )

    targets = {experts_module_name(layer): layer for layer in layers}
    # Every auto-quantize module owns parameters; list all other such modules by exact name.
    disabled = [
        name
        for name, module in model.named_modules()
        if name and name not in targets and next(module.parameters(recurse=False), None) is not None
    ]
    recipe_format = {QuantRecipe(quant_cfg=copy.deepcopy(MODELOPT_FORMATS[f])): f for f in formats}
    recipe_format[QuantRecipe(quant_cfg=None)] = BF16
    constraints: dict[str, Any] = {"effective_bits": float(effective_bits)}
    if cost_model is not None:
        constraints["cost_model"] = MODELOPT_COST_MODELS[cost_model]
        constraints["cost"] = {"excluded_module_name_patterns": list(disabled)}
        if cost_model == "active_moe":
            constraints["cost"]["active_moe_expert_ratio"] = float(active_moe_expert_ratio)

    work = model if in_place else copy.deepcopy(model)
    work.eval()
    patch = cpu_nvfp4_fake_quant() if not torch.cuda.is_available() else contextlib.nullcontext()
    with _quiet(not progress), patch, torch.inference_mode():
        work, state = mtq.auto_quantize(
            work,
            constraints=copy.deepcopy(constraints),
            quantization_formats=[copy.deepcopy(MODELOPT_FORMATS[f]) for f in formats],
            data_loader=batches,
            forward_step=_forward_step,
            disabled_layers=disabled,
            num_calib_steps=len(batches),
            num_score_steps=len(batches),
            verbose=progress,
            method="kl_div",
        )

    impl = getattr(work.config, "_experts_implementation", None)
    if impl != "eager":
        raise RuntimeError(f"experts implementation after auto_quantize is {impl!r}, expected 'eager'")

    hparams = {name: hp for name, hp in named_hparams(work, unique=True) if isinstance(hp, QuantRecipeHparam)}
    searched = {name: hp for name, hp in hparams.items() if hp.is_configurable}
    want = {f"{module}.quant_recipe": layer for module, layer in targets.items()}
    if set(searched) != set(want):
        raise RuntimeError(f"auto_quantize searched groups {sorted(searched)}, expected {sorted(want)}")
    scored_elsewhere = sorted(
        name
        for name, hp in hparams.items()
        if name not in want and any(v is not None for d in hp._importance_dict.values() for v in d.values())
    )
    if scored_elsewhere:
        raise RuntimeError(f"auto_quantize scored groups outside the request: {scored_elsewhere}")

    result: dict[str, Any] = {
        "scores": {},
        "clamped_scores": {},
        "costs": {},
        "selection": {},
        "selection_satisfied": bool(state["best"]["is_satisfied"]),
        "cost_denominator": float(state["cost_denominator"]),
        "effective_bits": float(state["best"]["constraints"]["effective_bits"]),
        "constraints": constraints,
        "tokens": int(calibration_ids.numel()),
        "batches": len(batches),
        "modelopt_version": modelopt.__version__,
    }
    for name, layer in sorted(want.items(), key=lambda item: item[1]):
        hp = searched[name]
        if hp.quant_module_names != [experts_module_name(layer)]:
            raise RuntimeError(f"group {name} holds modules {hp.quant_module_names}")
        if set(hp.choices) != set(recipe_format):
            raise RuntimeError(f"group {name} has choices {hp.choices}, expected {list(recipe_format)}")
        raw = {}
        for recipe, fmt in recipe_format.items():
            if fmt != BF16 and any(v is None for v in hp._importance_dict[recipe].values()):
                raise RuntimeError(f"group {name} has no {fmt} score")
            raw[fmt] = float(hp.get_score(recipe))
        stats = state["candidate_stats"][name]
        names = [recipe_format[recipe] for recipe in stats["formats"]]
        clamped = dict(zip(names, stats["scores"], strict=True))
        costs = dict(zip(names, stats["costs"], strict=True))
        result["scores"][layer] = {fmt: raw[fmt] for fmt in [*formats, BF16]}
        result["clamped_scores"][layer] = {fmt: float(clamped[fmt]) for fmt in [*formats, BF16]}
        result["costs"][layer] = {fmt: float(costs[fmt]) for fmt in [*formats, BF16]}
        result["selection"][layer] = recipe_format[state["best"]["recipe"][name]]
    experts_cost = math.fsum(costs[BF16] for costs in result["costs"].values())
    if cost_model is not None and not math.isclose(result["cost_denominator"], experts_cost, rel_tol=1e-12):
        raise RuntimeError(
            f"auto_quantize cost denominator {result['cost_denominator']} is not the experts' {experts_cost}"
        )
    return result
