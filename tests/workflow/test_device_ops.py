"""No device stage of the default DAG runs an op that CUDA refuses under deterministic algorithms.

On CUDA the device stages -- the stages whose registry device is not "cpu": collect_activation_stats,
collect_expert_inputs, quantize_layer, score_sensitivity, refine_placement, autoquantize_placement, and
reference_logits and run_kld with the hf engine -- run with
``torch.use_deterministic_algorithms(True)`` (``mixquant.numerics.CUDA_PROFILE``), where an op without a
deterministic CUDA kernel raises. CI has no GPU, so each device job's own runner
(``STAGES[stage].runner``, called as ``mixquant run`` calls it, with the artifact's settings and key) runs
here on the CPU under tests/cuda_alerts.py's recorder, with deterministic algorithms on, and every aten op
it dispatches is judged as CUDA would judge it. The CPU stages they need (fetch_model, sample_calibration,
pin_prompt, export_checkpoint, solve_placement for the refinement's input) run unrecorded; the rebuild's
placement is handed to ``resolve_artifacts``.

Covered, on the shipped toy (Laguna: sliding and full attention) and on tiny random qwen3_moe and
deepseek_v3 instances (tests/families; DeepSeek: MLA attention, grouped routing, a shared expert), each the
default config cut to 4 calibration sequences of 32 tokens and a 32-token prompt, one MoE layer pinned to
NVFP4 and one to FP8 (the toy's others to BF16), one layer per quantize job, NVFP4 rounded with GPTQ and the
placement refined by measured KL:

* collect_activation_stats: the streamed BF16 forward (eager experts) recording expert-input and K/V amax;
* collect_expert_inputs: the same forward recording each MoE layer's expert inputs and routing;
* quantize_layer: an NVFP4 window (``fp8_sweep``, the FP8-code sweep, then GPTQ rounding: per-expert
  Hessians, Cholesky factorisations, the error feedback), an FP8 window (MSE weights, static inputs from
  the statistics) and BF16 windows;
* score_sensitivity: the branch-parallel KL scores of the NVFP4 and the FP8 layer from the rebuilt
  weights, branches run alone on the toy (the default) and stacked on the others (the GPU setting);
* refine_placement: the streamed measurement of the candidate placements (here the pinned one);
* autoquantize_placement: ModelOpt's own ``auto_quantize(method="kl_div")`` (its calibration and scores,
  the NVFP4 fake quant through the CPU replacement where ModelOpt would run its CUDA kernel);
* reference_logits (the prompt's and the evaluation suite's, one 32-token window per domain, two captures),
  and run_kld of the exported mixed checkpoint: one run with a BF16 and one with an FP8 KV cache.

Not covered: what only CUDA dispatches (SDPA picks a CUDA backend op instead of the CPU one; kernels
inside ModelOpt's CUDA extensions), backward ops (no stage differentiates), and the prefetch thread's
reads (the recorder follows one thread).
"""

from __future__ import annotations

import importlib
import sys
from collections import defaultdict
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "families"))
from cuda_alerts import OpRecorder, recording  # noqa: E402
from family_models import make_instance  # noqa: E402
from mixquant.config import load_config_file, parse_layer_ranges  # noqa: E402
from mixquant.facts import placement_pins  # noqa: E402
from mixquant.graph import resolve_artifacts  # noqa: E402
from mixquant.keys.stages import STAGES  # noqa: E402
from mixquant.model.families import architecture  # noqa: E402
from mixquant.model.fetch import identity_sha256, local_dir_identity  # noqa: E402
from mixquant.numerics import enter  # noqa: E402
from mixquant.release.recipe import layer_ranges  # noqa: E402

pytestmark = pytest.mark.slow

DEVICE_STAGES = {name for name, spec in STAGES.items() if spec.device != "cpu"}
# What each device stage must be seen to run, proving the recorder saw its work: the eager experts'
# index_add_ (atomic on CUDA, deterministic with the mode on: the doc lists "torch.index_add when called on
# CUDA tensor" among the ops that then "act deterministically"), the NVFP4 sweep's probe search, the KL's
# log-softmax.
MARKERS = {
    "collect_activation_stats": "aten::index_add_",
    "collect_expert_inputs": "aten::index_add_",
    "quantize_layer": "aten::searchsorted",
    "refine_placement": "aten::_log_softmax",
    "score_sensitivity": "aten::_log_softmax",
    "reference_logits": "aten::index_add_",
    "run_kld": "aten::_log_softmax",
    "autoquantize_placement": "aten::kl_div",  # ModelOpt's kl_div scores
}


def small_config(wd, name: str, model: dict | None = None, stack_branches: bool = False) -> str:
    """The default config (or its model section replaced) cut to the smallest run of every device path:
    every MoE layer pinned, the first to NVFP4, the second to FP8, the others to BF16."""
    config = wd.config()
    if model is not None:
        config["model"] = model
    first, *others = parse_layer_ranges(config["model"]["moe_layers"])
    pins = [{"layers": str(first), "format": "nvfp4_w4a16"}, {"layers": str(others[0]), "format": "fp8"}]
    if others[1:]:
        pins.append({"layers": layer_ranges(others[1:]), "format": "bf16"})
    config["calibration"].update(num_samples=4, seq_len=32)
    config["prompt"].update(seq_len=32, sha256=None)
    config["placement"]["target_effective_bits"] = 16.0
    config["placement"]["search"].update(
        batch_size=2, macro_batch=4, stack_branches=stack_branches, pins=pins
    )
    config["quantize"].update(activation_batch_size=4, layers_per_job=1)
    config["quantize"]["nvfp4_w4a16"].update(rounding="gptq", gptq={"min_tokens": 1})
    config["placement"]["search"]["refine"] = {"candidates": 2, "holdout_samples": 2}
    kld = config["kld"]
    kld.update(runs=1, kv_cache_dtypes=["bfloat16", "fp8"], baseline=None)
    kld["candidates"] = [
        {"name": "searched", "source": "searched"},
        {"name": "modelopt", "source": "modelopt_autoquantize"},  # ModelOpt's auto_quantize on the device
    ]
    kld["gates"]["gated"] = None
    kld["eval"]["window_tokens"] = 32  # the suite: one short window per domain
    for domain in kld["eval"]["domains"]:
        domain["windows"] = 1
    config.pop("published", None)
    return wd.write_config(f"config/{name}.yaml", config)


def family_model(wd, model_type: str) -> dict:
    """The model section of a tiny random ``model_type`` (tests/families) in the workdir."""
    model_dir = make_instance(model_type, wd.root / "models" / model_type)
    return {
        "source": "local",
        "local": {"path": f"models/{model_type}", "sha256": identity_sha256(local_dir_identity(model_dir))},
        "geometry": f"models/{model_type}/config.json",
        "moe_layers": layer_ranges(list(architecture(model_dir).moe_layers)),
    }


def run_device_stages(configfile: str) -> dict[str, list[tuple[str, OpRecorder]]]:
    """Run every device artifact (and the CPU artifacts upstream of them) in dependency order, each device
    job under its own recorder: {stage: [(artifact name, recorder)]}."""
    cfg = load_config_file(configfile)
    artifacts = resolve_artifacts(cfg, placement=placement_pins(cfg))  # every layer pinned: no solve
    needed: set[str] = set()

    def need(name: str) -> None:
        if name not in needed:
            needed.add(name)
            for upstream in artifacts[name].upstream.values():
                need(upstream)

    for name, art in artifacts.items():
        if art.stage in DEVICE_STAGES:
            need(name)
    recorders: dict[str, list[tuple[str, OpRecorder]]] = defaultdict(list)
    for name, art in artifacts.items():
        if name not in needed:
            continue
        module, function = STAGES[art.stage].runner.split(":")
        runner = getattr(importlib.import_module(module), function)
        paths = {role: artifacts[upstream].path for role, upstream in art.upstream.items()}
        if art.stage not in DEVICE_STAGES:
            runner(art.path, **paths, settings=art.settings, preimage=art.preimage)
            continue
        with recording() as recorder:
            runner(art.path, **paths, settings=art.settings, preimage=art.preimage)
        recorders[art.stage].append((name, recorder))
    return recorders


@pytest.mark.parametrize("model", ["toy", "qwen3_moe", "deepseek_v3"])
def test_device_stages_run_no_op_cuda_refuses(workdir, monkeypatch, model):
    monkeypatch.chdir(workdir.root)
    enter("portable", 1)  # as `mixquant run` enters the job's profile
    if model == "toy":
        configfile = small_config(workdir, model)
    else:
        configfile = small_config(workdir, model, family_model(workdir, model), stack_branches=True)
    recorders = run_device_stages(configfile)

    assert set(recorders) == DEVICE_STAGES
    formats = {name.split("/")[1] for name, _ in recorders["quantize_layer"]}
    assert formats >= {"nvfp4_w4a16", "fp8"}
    kv = {name.rsplit("/", 1)[1] for name, _ in recorders["run_kld"]}
    assert kv == {"bfloat16", "fp8"}
    alerts = {}
    for runs in recorders.values():
        for name, recorder in runs:
            assert sum(recorder.ops.values()) > 100, f"{name}: the recorder saw {dict(recorder.ops)}"
            alerts.update({f"{name}: {op}": rule for op, rule in recorder.alerts.items()})
    assert alerts == {}
    for stage, runs in recorders.items():
        assert any(recorder.seen(MARKERS[stage]) for _, recorder in runs), f"{stage}: no {MARKERS[stage]}"
    gptq = [recorder for name, recorder in recorders["quantize_layer"] if name.startswith("layers/nvfp4")]
    assert gptq and all(recorder.seen("aten::linalg_cholesky_ex") for recorder in gptq)  # GPTQ ran
