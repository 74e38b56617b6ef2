"""Config sections ``numerics`` (the CPU numerics profile and device) and ``software`` (where jobs run: conda
environments or this venv)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from mixquant.config.base import Strict


class NumericsSection(Strict):
    device: str = Field(
        default="cpu",
        pattern=r"^(cpu|cuda(:[0-9]+)?)$",
        description="Where the forward stages (collect_activation_stats, score_sensitivity, the hf engine's "
        "reference_logits and run_kld) and quantize_layer compute: cpu, cuda or cuda:N. Streamed a decoder "
        "layer at a time on either. The device type and its numerics enter those stages' keys (the "
        "rebuild keeps ModelOpt's export numerics on every device).",
    )
    cpu: Literal["portable", "native"] = Field(
        default="portable",
        description="CPU numerics profile of every process that computes on CPU (mixquant.numerics): "
        "portable pins ATen's CPU capability (AVX2), oneDNN off, MKL_CBWR=COMPATIBLE and the thread count, "
        "so any x86-64 host with AVX2 (Intel or AMD, with or without AVX512) gives the same bits; native "
        "leaves the host's defaults (faster; the host's ISA then enters the keys). GPU runs are unaffected.",
    )
    threads: int = Field(
        default=1,
        ge=1,
        description="Intra-op threads of every computing process (torch, OpenMP, MKL); part of the profile "
        "and of the keys. One thread per job lets Snakemake run jobs side by side.",
    )


class SoftwareSection(Strict):
    deployment: Literal["auto", "conda", "venv"] = Field(
        default="auto",
        description="Where jobs run, which decides the package versions in every key: conda (the "
        "environments Snakemake builds from envs/quant.yaml and envs/serve.yaml: their exact pins and file "
        "hashes enter the keys), venv (the Python environment Snakemake runs in: its installed versions), "
        "or auto (as Snakemake deploys: conda under --sdm conda or a profile that sets it, else venv; "
        "`mixquant` commands follow their --profile). A run deployed otherwise than a conda or venv setting "
        "says stops at planning.",
    )
    vllm_python: str | None = Field(
        default=None,
        description="venv deployment with kld.engine: vllm: the Python of a separate venv that has vLLM "
        "(vLLM pins its own torch and transformers, so it cannot share mixquant's venv). The vLLM stages run "
        "their engine there, and its package versions enter their keys. null: vLLM must be importable where "
        "Snakemake runs. Not used under conda (envs/serve.yaml has vLLM).",
    )
