"""Stage entry points of the KLD protocol: reference_logits, run_kld, gate_kld, kld_report, check_kld_gates.

Files:

* ``reference_logits``: ``logits.safetensors`` (``logits``: float32 [T-1, V], logits of prompt positions
  0..T-2 of the BF16 model with a BF16 KV cache) and ``reference.json``: engine settings and info, and the
  SHA-256 of the logits' canonical encoding -- the float32 values as little-endian IEEE-754 bytes in
  row-major order [T-1, V], no header (the bytes ``numpy.ascontiguousarray(x, "<f4").tobytes()`` gives).
* ``run_kld``: every run of one (candidate, KV dtype) under ``runs/<i>/`` (``i`` = 0..runs-1), each with
  ``kld.json`` (the run's statistics, engine info) and ``per_position.safetensors`` (``kl``, ``p_ref``,
  ``p_cand``, ``ref_nll``, ``cand_nll`` float64 [T-1]; ``top1_same`` uint8). Each run builds a fresh
  engine: a new engine object in the job's process for ``hf`` (deterministic, in-process), a new Python
  process per run for ``vllm`` (whose engine state, CUDA context and allocator outlive the object).
* ``gate_kld``: ``aggregate.json`` -- the runs' aggregate, the paired comparison with the baseline, the
  gates and the verdict -- and ``per_position_mean.safetensors`` (the mean per-position KL over runs).
* ``kld_report``: ``kld_table.csv`` / ``kld_table.md`` (candidates x KV), ``kl_cdf_<kv>.png``,
  ``kl_per_position_<kv>.png`` and ``report.json`` (every verdict).
* ``check_kld_gates``: ``verdict.json``, written only when every gate passed; otherwise the stage fails with
  one line listing the failed checks (the aggregates and the report stay for inspection).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import mixquant
from mixquant.keys.environments import SoftwareError, check_software
from mixquant.keys.hashing import file_sha256
from mixquant.keys.manifest import publish_keyed_dir
from mixquant.kld.settings import EngineError, EngineSettings
from mixquant.model.fetch import resolve_model_dir
from mixquant.numerics import fingerprint, portable_environment, requested

log = logging.getLogger(__name__)

LOGITS_FILE = "logits.safetensors"
REFERENCE_JSON = "reference.json"
RUNS_DIR = "runs"
RUN_JSON = "kld.json"
PER_POSITION_FILE = "per_position.safetensors"
AGGREGATE_JSON = "aggregate.json"
MEAN_FILE = "per_position_mean.safetensors"
REPORT_JSON = "report.json"
VERDICT_JSON = "verdict.json"
ENCODING = "float32 little-endian IEEE-754, row-major [T-1, V], no header"


class KldGateFailure(RuntimeError):
    """A KLD gate failed (one line naming the candidates, KV dtypes and checks)."""


class KldRunError(RuntimeError):
    """A KLD run failed or its results are incomplete (one line naming the run)."""


def run_dir(runs_dir: str | Path, run: int) -> Path:
    """The directory of run ``run`` inside a run_kld output."""
    return Path(runs_dir) / RUNS_DIR / str(int(run))


def logits_sha256(logits) -> str:
    """SHA-256 of the canonical encoding of float32 logits (see the module docstring)."""
    import numpy as np

    array = np.ascontiguousarray(logits.detach().to("cpu").float().numpy(), dtype="<f4")
    return hashlib.sha256(array.tobytes()).hexdigest()


def _engine_settings(settings: dict[str, Any], kv: str, threads: int | None):
    device = settings.get("numerics", {}).get("device") if settings["engine"]["engine"] == "hf" else None
    return EngineSettings(**settings["engine"], kv_cache_dtype=kv, threads=threads, device=device)


def _prompt_ids(prompt: str | Path):
    from mixquant.calibration.tokens import load_token_ids  # lazy: imports torch

    return load_token_ids(Path(prompt) / "prompt.safetensors").reshape(-1).long()


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, allow_nan=True) + "\n", encoding="utf-8")


def _logits(model_dir: Path, settings: dict[str, Any], kv: str, ids) -> tuple[Any, dict[str, Any], float]:
    from mixquant.kld.engines import open_engine  # lazy: imports torch
    from mixquant.model.layer_reader import check_checkpoint_shards  # lazy: imports torch

    check_checkpoint_shards(model_dir)  # a broken shard stops here with one line naming it
    started = time.perf_counter()
    engine = open_engine(model_dir, _engine_settings(settings, kv, settings.get("threads")))
    try:
        logits = engine.prompt_logits(ids)
        info = engine.info()
    finally:
        engine.close()
    return logits, info, time.perf_counter() - started


def run_reference_logits(
    out_dir: str | Path,
    *,
    model: str | Path,
    prompt: str | Path,
    settings: dict[str, Any],
    preimage: dict[str, Any],
) -> Path:
    """The BF16 model's logits on the pinned prompt (BF16 KV cache), float32 [T-1, V].

    reference.json records, besides the hash and the engine, the numerics fingerprint the logits were
    computed under (top-level ``numerics``, mixquant.numerics): their hash is a numerical one, which
    ``mixquant verify`` expects to reproduce bit for bit only under an equal decisive fingerprint.
    """
    from mixquant.checkpoint.writer import save_file_sorted  # lazy: imports torch

    if _fresh_process_engine(settings):
        logits, info, seconds = _logits_in_fresh_process(
            model, prompt, settings, preimage, Path(out_dir).parent
        )
    else:
        logits, info, seconds = _logits(resolve_model_dir(model), settings, "bfloat16", _prompt_ids(prompt))
    sha = logits_sha256(logits)
    if info.get("numerics") is None:  # an engine that does not record its own
        info = {**info, "numerics": fingerprint()}
    document = {
        "sha256": sha,
        "encoding": ENCODING,
        "shape": list(logits.shape),
        "positions": int(logits.shape[0]),
        "engine_settings": {**settings["engine"], "kv_cache_dtype": "bfloat16"},
        "engine": info,
        "numerics": info["numerics"],
    }
    summary: dict[str, Any] = {}
    with publish_keyed_dir(out_dir, preimage, summary) as tmp:
        save_file_sorted({"logits": logits.contiguous()}, tmp / LOGITS_FILE, {"sha256": sha})
        _write_json(tmp / REFERENCE_JSON, document)
        summary.update(sha256=sha, shape=list(logits.shape), seconds=round(seconds, 3), engine=info)
    log.info("reference logits %s, sha256 %s", tuple(logits.shape), sha)
    return Path(out_dir)


def run_kld(
    out_dir: str | Path,
    *,
    reference: str | Path,
    prompt: str | Path,
    candidate: str | Path,
    settings: dict[str, Any],
    preimage: dict[str, Any],
) -> Path:
    """All ``settings["runs"]`` runs of one (candidate, KV dtype), each a fresh engine: KL(reference ||
    candidate) at every prompt position, full vocabulary, under ``runs/<i>/``."""
    runs = int(settings["runs"])
    if runs < 1:
        raise KldRunError(f"run_kld: runs must be at least 1, got {runs}")
    in_process = not _fresh_process_engine(settings)
    means: list[float] = []
    summary: dict[str, Any] = {}
    with publish_keyed_dir(out_dir, preimage, summary) as tmp:
        ids, ref = _run_inputs(prompt, reference)  # inputs, not engine state: read once
        for run in range(runs):
            target = run_dir(tmp, run)
            if in_process:
                document = _one_run(target, ids, ref, candidate, settings, run)
            else:
                logits, info, seconds = _logits_in_fresh_process(
                    candidate, prompt, settings, preimage, tmp, settings["kv_cache_dtype"], f"run {run}"
                )
                document = _write_run(target, ids, ref, logits, info, seconds, settings, run)
            means.append(document["summary"]["mean_kld"])
        summary.update(kv_cache_dtype=settings["kv_cache_dtype"], runs=runs, mean_kld=means)
    return Path(out_dir)


def _run_inputs(prompt: str | Path, reference: str | Path):
    from safetensors.torch import load_file

    return _prompt_ids(prompt), load_file(str(Path(reference) / LOGITS_FILE))["logits"]


def _one_run(
    target: Path, ids, ref, candidate: str | Path, settings: dict[str, Any], run: int
) -> dict[str, Any]:
    """One run with a fresh engine in this process: write ``kld.json`` and ``per_position.safetensors``."""
    logits, info, seconds = _logits(resolve_model_dir(candidate), settings, settings["kv_cache_dtype"], ids)
    return _write_run(target, ids, ref, logits, info, seconds, settings, run)


def _write_run(
    target: Path, ids, ref, logits, info: dict[str, Any], seconds: float, settings: dict[str, Any], run: int
) -> dict[str, Any]:
    """KL(reference || candidate) of one run's logits: ``kld.json`` and ``per_position.safetensors`` into
    ``target``. Computed by the job's own process, under its numerics profile, whichever process the engine
    ran in."""
    import torch

    from mixquant.checkpoint.writer import save_file_sorted  # lazy: imports torch
    from mixquant.kld.stats import kld_statistics  # lazy: imports torch

    kv = settings["kv_cache_dtype"]
    if logits.shape != ref.shape:
        raise ValueError(f"candidate logits {tuple(logits.shape)} vs reference {tuple(ref.shape)}")
    started = time.perf_counter()
    stats = kld_statistics(ref, logits, ids[1:])
    per = stats["per_position"]
    tensors = {name: per[name].to(torch.float64).contiguous() for name in ("kl", "p_ref", "p_cand")}
    tensors.update({name: per[name].to(torch.float64).contiguous() for name in ("ref_nll", "cand_nll")})
    tensors["top1_same"] = per["top1_same"].to(torch.uint8).contiguous()
    document = {
        "run": run,
        "kv_cache_dtype": kv,
        "summary": stats["summary"],
        "candidate_logits_sha256": logits_sha256(logits),
        "engine_settings": {**settings["engine"], "kv_cache_dtype": kv},
        "engine": info,
    }
    target.mkdir(parents=True, exist_ok=True)
    save_file_sorted(tensors, target / PER_POSITION_FILE, None)
    _write_json(target / RUN_JSON, document)
    log.info(
        "run %d (%s KV): mean KLD %.6g (engine %.2f s, statistics %.2f s)",
        run,
        kv,
        stats["summary"]["mean_kld"],
        seconds,
        time.perf_counter() - started,
    )
    return document


def _fresh_process_engine(settings: dict[str, Any]) -> bool:
    """Whether the engine runs in a fresh process: vLLM always (its engine-core and worker processes, CUDA
    context and allocator outlive the Python object; it may live in another interpreter); hf in-process."""
    return settings["engine"]["engine"] == "vllm"


def _logits_in_fresh_process(
    model: str | Path,
    prompt: str | Path,
    settings: dict[str, Any],
    preimage: dict[str, Any] | None,
    beside: Path,
    kv_cache_dtype: str = "bfloat16",
    label: str = "reference",
) -> tuple[Any, dict[str, Any], float]:
    """A model's logits on the prompt from an engine in a new Python process (:func:`engine_process`), its
    files in a scratch directory in ``beside`` (the output's filesystem: the logits of a real model's
    2,048-token prompt are 0.8 GB)."""
    from safetensors.torch import load_file

    started = time.perf_counter()
    with _scratch(beside) as scratch:
        task = {
            "task": "logits",
            "model": str(model),
            "prompt": str(prompt),
            "kv_cache_dtype": kv_cache_dtype,
        }
        engine_process(task, settings, preimage, scratch, label)
        logits = load_file(str(scratch / LOGITS_FILE))["logits"]
        info = json.loads((scratch / ENGINE_JSON).read_text(encoding="utf-8"))
    return logits, info, time.perf_counter() - started


ENGINE_JSON = "engine.json"
DONE_JSON = "done.json"  # the child's last write: its files and their SHA-256


@contextlib.contextmanager
def _scratch(beside: Path):
    """A fresh directory for a child's files (beside the output, on the same filesystem), always removed."""
    beside.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=".engine-", dir=beside))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def engine_process(
    task: dict[str, Any],
    settings: dict[str, Any],
    preimage: dict[str, Any] | None,
    scratch: Path,
    label: str,
) -> list[str]:
    """Run one engine task in a new Python process writing into ``scratch``; the names of the files it wrote.

    The child is ``python -m mixquant.kld.run SPEC`` (a module run under a ``__main__`` guard: vLLM starts its
    workers with ``spawn``, which re-imports the main module) in ``software.vllm_python`` when set, else this
    interpreter; mixquant comes from this process's copy (no env installs it), the environment is inherited
    (for vLLM without the CPU numerics profile: :func:`vllm_environment`), its output goes to this job's log.
    The child first checks its packages
    against the key (:func:`mixquant.keys.environments.check_software`), and last writes ``done.json``: the
    run is judged by its files against that list, not by the exit status (vLLM's teardown has been seen to
    abort after the output was complete: rc 134, "terminate called without an active exception").
    """
    software = settings.get("software") or {}
    python = software.get("python") or sys.executable
    spec = {
        **task,
        "settings": settings,
        "packages": (preimage or {}).get("packages"),
        "out": str(scratch),
    }
    package_root = str(Path(mixquant.__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    if settings["engine"]["engine"] == "vllm":
        env = vllm_environment(env)
    spec_path = scratch / "spec.json"
    _write_json(spec_path, spec)
    started = time.perf_counter()
    done = subprocess.run(
        [python, "-m", "mixquant.kld.run", str(spec_path)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    output = (done.stdout + done.stderr).strip()
    if output:
        log.info("%s process output:\n%s", label, output)
    spec_path.unlink(missing_ok=True)
    files = _completed_files(scratch)
    if files is None:
        last = _last_line(output)
        raise KldRunError(f"{label}: the engine process exited with {done.returncode}: {last}")
    if done.returncode != 0:
        log.warning(
            "%s: the engine process exited with %d after writing its complete output (checked against its "
            "done.json): accepted",
            label,
            done.returncode,
        )
    log.info("%s: fresh process %.1f s", label, time.perf_counter() - started)
    return files


def vllm_environment(env: dict[str, str]) -> dict[str, str]:
    """The engine process's environment for vLLM: without the CPU numerics profile of mixquant's stages.

    vLLM places itself and picks its own kernels by what the CPU has (its CPU build's BF16 GEMMs use
    oneDNN's AMX/AVX512 micro-kernels and abort under ONEDNN_MAX_CPU_ISA=AVX2) and its own threads; the
    profile pins torch's paths for what mixquant computes, which the job's own process still does (the KL
    statistics). The engine's fingerprint then records the host's native numerics.
    """
    out = {name: value for name, value in env.items() if name not in portable_environment()}
    out["MIXQUANT_NUMERICS"] = f"native:{requested()[1]}"
    return out


def _last_line(output: str) -> str:
    """The child's own one-line error (``mixquant: ...``), else its last line."""
    lines = output.splitlines()
    ours = [line for line in lines if line.startswith("mixquant: ")]
    return (ours or lines or ["no output"])[-1].removeprefix("mixquant: ")


def _completed_files(scratch: Path) -> list[str] | None:
    """The files a child listed in ``done.json`` when every one is there with its SHA-256, else None."""
    try:
        listed = json.loads((scratch / DONE_JSON).read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError):
        return None
    for name, sha in listed.items():
        path = scratch / name
        if not path.is_file() or file_sha256(path) != sha:
            return None
    (scratch / DONE_JSON).unlink()
    return sorted(listed)


def run_engine_task(spec_path: str | Path) -> None:
    """The child of :func:`engine_process`: a model's logits on the prompt, as the spec file describes."""
    spec = json.loads(Path(spec_path).read_text(encoding="utf-8"))
    settings, out = spec["settings"], Path(spec["out"])
    if spec.get("packages") is not None:  # the engine's own packages are the ones its key holds
        check_software({"packages": spec["packages"]}, settings.get("software"))
    if spec["task"] != "logits":
        raise KldRunError(f"engine task {spec['task']!r} is not 'logits'")
    from mixquant.checkpoint.writer import save_file_sorted  # lazy: imports torch

    ids = _prompt_ids(spec["prompt"])
    logits, info, _ = _logits(resolve_model_dir(spec["model"]), settings, spec["kv_cache_dtype"], ids)
    save_file_sorted({"logits": logits.contiguous()}, out / LOGITS_FILE, None)
    _write_json(out / ENGINE_JSON, info)
    written = [LOGITS_FILE, ENGINE_JSON]
    _write_json(out / DONE_JSON, {"files": {name: file_sha256(out / name) for name in written}})


def main(argv: list[str] | None = None) -> int:
    """``python -m mixquant.kld.run SPEC``: :func:`run_engine_task`, its failure as one ``mixquant:`` line."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = sys.argv[1:] if argv is None else argv
    try:
        run_engine_task(args[0])
    except Exception as error:  # noqa: BLE001 - one line for the parent, the traceback above it
        logging.getLogger(__name__).exception("engine task failed")
        line = (str(error).splitlines() or [type(error).__name__])[0]
        if not isinstance(error, (EngineError, KldRunError, SoftwareError)):
            line = f"{type(error).__name__}: {line}"
        print(f"mixquant: {line}", file=sys.stderr, flush=True)
        return 1
    return 0


def _load_runs(directory: str | Path) -> list[dict[str, Any]]:
    """Every run of a run_kld output, in run order (``runs/0``, ``runs/1``, ...)."""
    from safetensors.torch import load_file

    root = Path(directory) / RUNS_DIR
    found = sorted(int(p.name) for p in root.iterdir() if p.name.isdigit()) if root.is_dir() else []
    if not found or found != list(range(len(found))):
        raise KldRunError(f"{root}: expected runs 0..n-1, found {found}")
    runs = []
    for run in found:
        path = run_dir(directory, run)
        document = json.loads((path / RUN_JSON).read_text(encoding="utf-8"))
        kl = load_file(str(path / PER_POSITION_FILE))["kl"]
        runs.append({"summary": document["summary"], "kl": kl, "engine": document["engine"]})
    return runs


def run_gate_kld(
    out_dir: str | Path,
    *,
    runs: str | Path,
    baseline_runs: str | Path | None = None,
    settings: dict[str, Any],
    preimage: dict[str, Any],
) -> Path:
    """Aggregate one (candidate, KV dtype)'s runs (a run_kld output), compare with the baseline's runs,
    apply the gates."""
    from mixquant.checkpoint.writer import save_file_sorted  # lazy: imports torch
    from mixquant.kld.report import (  # lazy: imports torch
        aggregate_runs,
        aggregate_to_json,
        evaluate_gates,
        paired_improvement,
    )

    own = _load_runs(runs)
    base = _load_runs(baseline_runs) if baseline_runs is not None else []
    aggregate = aggregate_runs(own)
    gates = settings["gates"]
    improvement = None
    if base:
        baseline = aggregate_runs(base)
        improvement = paired_improvement(
            aggregate["kl"],
            baseline["kl"],
            samples=gates["bootstrap_samples"],
            confidence=gates["confidence"],
        )
    applied: dict[str, Any] = {"require_exact_zero": settings["require_exact_zero"]}
    if settings["gated"]:
        applied.update(
            max_mean_kld=gates["max_mean_kld"],
            max_run_spread=gates["max_run_spread"],
            min_improvement=gates["min_improvement"] if base else None,
        )
    verdict = evaluate_gates(aggregate, applied, improvement)
    if settings["require_identical_runs"]:
        identical = bool(aggregate["identical_runs"])
        verdict["checks"].append(
            {"name": "identical_runs", "value": identical, "limit": True, "passed": identical}
        )
        verdict["passed"] = verdict["passed"] and identical
    document = {
        "candidate": settings["candidate"],
        "source": settings["source"],
        "kv_cache_dtype": settings["kv_cache_dtype"],
        "baseline": settings["baseline"],
        "aggregate": aggregate_to_json(aggregate),
        "improvement": improvement,
        "gates": applied,
        "verdict": verdict,
        "engine": own[0]["engine"],
    }
    summary: dict[str, Any] = {}
    with publish_keyed_dir(out_dir, preimage, summary) as tmp:
        _write_json(tmp / AGGREGATE_JSON, document)
        save_file_sorted({"kl": aggregate["kl"].contiguous()}, tmp / MEAN_FILE, None)
        summary.update(mean_kld=aggregate["mean_kld"], passed=verdict["passed"])
    log.info(
        "%s (%s KV): mean KLD %.6g over %d runs, %s",
        settings["candidate"],
        settings["kv_cache_dtype"],
        aggregate["mean_kld"],
        aggregate["runs"],
        "pass" if verdict["passed"] else "FAIL",
    )
    return Path(out_dir)


def run_kld_report(
    out_dir: str | Path, *, settings: dict[str, Any], preimage: dict[str, Any], **gates: str
) -> Path:
    """The comparison table (CSV, Markdown) of every candidate x KV dtype, the plots and the verdicts."""
    from safetensors.torch import load_file

    from mixquant.kld.report import (  # lazy: imports torch
        comparison_table,
        plot_kl_cdf,
        plot_per_position,
        table_markdown,
        write_table,
    )

    rows, curves, verdicts = [], {}, []
    for kv in settings["kv_cache_dtypes"]:
        curves[kv] = {}
        for name in settings["candidates"]:
            directory = Path(gates[f"gate_{name}_{kv}"])
            document = json.loads((directory / AGGREGATE_JSON).read_text(encoding="utf-8"))
            rows.append(
                {
                    "candidate": name,
                    "kv_cache_dtype": kv,
                    "aggregate": document["aggregate"],
                    "improvement": document["improvement"],
                    "gates": document["verdict"] if document["verdict"]["checks"] else None,
                }
            )
            curves[kv][name] = load_file(str(directory / MEAN_FILE))["kl"]
            failed = [c for c in document["verdict"]["checks"] if not c["passed"]]
            verdicts.append(
                {
                    "candidate": name,
                    "kv_cache_dtype": kv,
                    "passed": document["verdict"]["passed"],
                    "failed": failed,
                }
            )
    table = comparison_table(rows)
    summary: dict[str, Any] = {}
    with publish_keyed_dir(out_dir, preimage, summary) as tmp:
        write_table(table, tmp / "kld_table.csv", tmp / "kld_table.md")
        for kv, by_candidate in curves.items():
            plot_kl_cdf(
                by_candidate, tmp / f"kl_cdf_{kv}.png", title=f"KL(BF16 || candidate) CDF, {kv} KV cache"
            )
            plot_per_position(
                by_candidate, tmp / f"kl_per_position_{kv}.png", title=f"Per-position KL, {kv} KV cache"
            )
        _write_json(tmp / REPORT_JSON, {"baseline": settings["baseline"], "verdicts": verdicts})
        summary.update(passed=all(v["passed"] for v in verdicts))
    log.info("KLD table:\n%s", table_markdown(table))
    return Path(out_dir)


def run_check_kld_gates(
    out_dir: str | Path, *, report: str | Path, settings: dict[str, Any], preimage: dict[str, Any]
) -> Path:
    """Publish ``verdict.json`` when every gate passed; otherwise fail with one line naming the failures."""
    document = json.loads((Path(report) / REPORT_JSON).read_text(encoding="utf-8"))
    failed = [v for v in document["verdicts"] if not v["passed"]]
    if failed:
        parts = []
        for v in failed:
            checks = ", ".join(f"{c['name']} {c['value']!r} (limit {c['limit']!r})" for c in v["failed"])
            parts.append(f"{v['candidate']}/{v['kv_cache_dtype']}: {checks}")
        raise KldGateFailure(f"KLD gates failed: {'; '.join(parts)} (see {Path(report)})")
    summary: dict[str, Any] = {}
    with publish_keyed_dir(out_dir, preimage, summary) as tmp:
        _write_json(tmp / VERDICT_JSON, {"passed": True, "verdicts": document["verdicts"]})
        summary.update(passed=True, checked=len(document["verdicts"]))
    return Path(out_dir)


if __name__ == "__main__":  # the engine process (engine_process); vLLM's spawned workers skip this
    sys.exit(main())
