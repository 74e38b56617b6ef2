"""The model card's serving section: ``vllm serve`` commands naming the release's Hub repository, and what
serving needs -- the GPU architecture each placed format needs in vLLM, the vLLM version the KLD runs
recorded, the weight memory per GPU from the checkpoint's safetensors bytes.

Read by mixquant.release.card; every value comes from the recipe, the checkpoint audit, the gate
aggregates' engine records or the shipped files, never from a constant version or size.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mixquant.kld.settings import VLLM_KV_CACHE_DTYPES

PLACEHOLDER_ORG = "<your-org>"  # the serve commands' namespace while release.repo_id is unset


def serve_model_id(recipe: Mapping[str, Any], name: str) -> str:
    """What ``vllm serve`` names: ``release.repo_id``, else the placeholder '<your-org>/<name>'."""
    return str(recipe["release"].get("repo_id") or f"{PLACEHOLDER_ORG}/{name}")


def serve_commands(recipe: Mapping[str, Any], model_id: str) -> list[str]:
    """``vllm serve`` with every numerics-deciding flag pinned, one per gated KV-cache dtype.

    No ``--quantization``: vLLM detects ModelOpt checkpoints from hf_quant_config.json / config.json's
    quantization_config (the KLD engine loads them the same way); ``--kv-cache-dtype`` is always explicit
    ("auto" would adopt the checkpoint's FP8 KV scales), with the mapping the vllm engine pins.
    """
    kld = recipe["kld"]
    commands = []
    for kv in kld["kv_cache_dtypes"]:
        flags = [
            f"--tensor-parallel-size {kld['tensor_parallel_size']}",
            f"--dtype {kld['dtype']}",
            f"--kv-cache-dtype {VLLM_KV_CACHE_DTYPES[kv]}",
        ]
        if kld.get("max_model_len"):
            flags.append(f"--max-model-len {kld['max_model_len']}")
        commands.append(f"vllm serve {model_id} \\\n    " + " \\\n    ".join(flags))
    return commands


def serving_section(
    recipe: Mapping[str, Any],
    inspection: Mapping[str, Any],
    gates: Sequence[Mapping[str, Any]],
    weight_bytes: int | None,
    name: str,
) -> list[str]:
    """The card's "Serving with vLLM" section: the serve commands and the requirements.

    ``inspection``: the checkpoint audit's; ``gates``: the gate_kld aggregates (their engine records);
    ``weight_bytes``: the checkpoint's safetensors files on disk.
    """
    counts = inspection["placement_counts"]
    model_id = serve_model_id(recipe, name)
    lines = ["## Serving with vLLM", ""]
    lines.append(
        "vLLM reads ModelOpt `MIXED_PRECISION` checkpoints from `hf_quant_config.json` (NVFP4 W4A16 experts "
        "via Marlin; layers the file does not list load as BF16) and picks `modelopt_mixed` itself, so "
        "no `--quantization` flag is needed (leaving it out is vLLM's auto-detection). "
        "Always pass `--kv-cache-dtype`: `auto` follows the checkpoint and would silently change the KV "
        "cache."
    )
    if not recipe["release"].get("repo_id"):
        lines += [
            "",
            f"Replace `{PLACEHOLDER_ORG}` below with the namespace this repository is uploaded to (mixquant "
            "writes the repository id in when the release's `repo_id` is set).",
        ]
    for kv, command in zip(recipe["kld"]["kv_cache_dtypes"], serve_commands(recipe, model_id), strict=True):
        lines += ["", f"{kv} KV cache (as gated above):", "", "```bash", command, "```"]
    if counts.get("fp8"):
        lines += [
            "",
            "Some vLLM versions reject FP8 MoE layers under the B12X (SM120 and SM121) W4A16 expert path; "
            "serve on a backend that accepts FP8 experts.",
        ]
    lines += ["", "### Requirements", "", *_requirements_lines(recipe, counts, gates, weight_bytes)]
    return lines


def _requirements_lines(
    recipe: Mapping[str, Any],
    counts: Mapping[str, int],
    gates: Sequence[Mapping[str, Any]],
    weight_bytes: int | None,
) -> list[str]:
    """GPU architecture the formats need in vLLM, the vLLM version the gates ran with, weight memory."""
    kernels = []
    if counts.get("nvfp4_w4a16"):
        # vLLM: marlin_utils_fp4.is_fp4_marlin_supported() is has_device_capability(80)
        kernels.append(
            "NVFP4 W4A16 experts run in vLLM's FP4 Marlin kernel (FP4 weights, BF16 activations), which "
            "needs compute capability 8.0 or newer: Ampere, Ada Lovelace, Hopper or Blackwell (Blackwell's "
            "FP4 tensor cores are not needed)"
        )
    if counts.get("fp8"):
        # vLLM: FP8 GEMMs on FP8 tensor cores from SM89; marlin_utils_fp8: the weight-only fallback from SM80
        kernels.append(
            "FP8 W8A8 experts use FP8 tensor cores from compute capability 8.9 (Ada Lovelace, Hopper, "
            "Blackwell); on 8.0-8.6 vLLM falls back to weight-only FP8 Marlin"
        )
    if not kernels:
        kernels.append("every routed expert is BF16")
    lines = ["- GPU: NVIDIA, compute capability 8.0 or newer. " + "; ".join(kernels) + "."]

    # the engine records the KLD runs wrote (each gate aggregate keeps its first run's)
    engines = [g["engine"] for g in gates if isinstance(g.get("engine"), Mapping)]
    vllm_versions = sorted(
        {str(e["versions"]["vllm"]) for e in engines if e.get("engine") == "vllm" and e.get("versions")}
    )
    gpus = sorted(
        {str(gpu) for e in engines if (gpu := ((e.get("numerics") or {}).get("decisive") or {}).get("gpu"))}
    )
    tp = recipe["kld"]["tensor_parallel_size"]
    if vllm_versions:
        lines.append(
            f"- vLLM: the KLD gates above ran with vLLM {', '.join(vllm_versions)}"
            + (f" on {', '.join(gpus)}" if gpus else "")
            + f", tensor parallel {tp}. Other vLLM versions may pick other kernels, and so other numerics."
        )
    else:
        others = sorted({str(e.get("engine")) for e in engines}) or [str(recipe["kld"]["engine"])]
        versions = sorted(
            {
                f"{package} {version}"
                for e in engines
                for package, version in (e.get("versions") or {}).items()
                if version and package != "modelopt"
            }
        )
        lines.append(
            f"- vLLM: no vLLM run was gated for this release: the KLD gates ran on the "
            f"{', '.join(f'`{name}`' for name in others)} engine"
            + (f" ({', '.join(versions)})" if versions else "")
            + ", so the numerics vLLM serves are not measured here."
        )
    if weight_bytes is not None:
        split = f", split {tp} ways" if tp > 1 else ""
        lines.append(
            f"- GPU memory: {_size(weight_bytes / tp)} of weights per GPU at tensor parallel {tp} "
            f"(the safetensors files hold {weight_bytes:,} bytes{split}); the KV cache, activations "
            "and CUDA graphs come on top, within vLLM's `--gpu-memory-utilization` share of each GPU."
        )
    return lines


def _size(n_bytes: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.2f} {unit}"
    return f"{n_bytes:,.0f} bytes"
