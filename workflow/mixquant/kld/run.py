"""Stage entry points of the KLD protocol that run an engine: reference_logits and run_kld.

What an engine scores (windows: the pinned prompt, or the evaluation suite) and how the reference is stored:
:mod:`mixquant.kld.capture`. Files:

* ``reference_logits``: the reference of every window (``logits.safetensors``: float32 [positions, V], or
  the top-k form ``reference_topk.safetensors``) and ``reference.json``: engine settings and info, the
  SHA-256 of the full logits' canonical encoding -- the float32 values as little-endian IEEE-754 bytes in
  row-major order, no header (what ``numpy.ascontiguousarray(x, "<f4").tobytes()`` gives) -- and, with more
  than one capture, the runtime noise floor: the mean KL of each further fresh-engine capture against the
  first (the largest of them; exactly 0 for a deterministic engine).
* ``run_kld``: every run of one (candidate, KV dtype) under ``runs/<i>/`` (``i`` = 0..runs-1), each with
  ``kld.json`` (the run's statistics, engine info) and ``per_position.safetensors`` (``kl``, ``p_ref``,
  ``p_cand``, ``ref_nll``, ``cand_nll`` float64 [positions]; ``top1_same`` uint8) for the prompt, and the
  same under ``runs/<i>/suite/`` for the evaluation suite when one is configured. Each run builds one fresh
  engine that scores the prompt and the suite: a new engine object in the job's process for ``hf``
  (deterministic, in-process), a new Python process per run for ``vllm`` (whose engine state, CUDA context
  and allocator outlive the object).

The gate, the report and the verdict: :mod:`mixquant.kld.gate`, :mod:`mixquant.kld.compare`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
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
TOPK_FILE = "reference_topk.safetensors"
REFERENCE_JSON = "reference.json"
RUNS_DIR = "runs"
SUITE_DIR = "suite"
RUN_JSON = "kld.json"
PER_POSITION_FILE = "per_position.safetensors"
AGGREGATE_JSON = "aggregate.json"
MEAN_FILE = "per_position_mean.safetensors"
REPORT_JSON = "report.json"
VERDICT_JSON = "verdict.json"
ENCODING = "float32 little-endian IEEE-754, row-major [positions, V], no header"
PASS_JSON = "pass.json"  # a pass's results (engine info, each task's record), written last by whoever ran it


class KldGateFailure(RuntimeError):
    """A KLD gate failed (one line naming the candidates, KV dtypes and checks)."""


class KldRunError(RuntimeError):
    """A KLD run failed or its results are incomplete (one line naming the run)."""


def run_dir(runs_dir: str | Path, run: int) -> Path:
    """The directory of run ``run`` inside a run_kld output."""
    return Path(runs_dir) / RUNS_DIR / str(int(run))


def logits_sha256(logits) -> str:
    """SHA-256 of the canonical encoding of float32 logits (see the module docstring)."""
    from mixquant.kld.capture import logits_sha256 as sha  # lazy: imports torch

    return sha(logits)


def _engine_settings(settings: dict[str, Any], kv: str) -> EngineSettings:
    device = settings.get("numerics", {}).get("device") if settings["engine"]["engine"] == "hf" else None
    return EngineSettings(
        **settings["engine"], kv_cache_dtype=kv, threads=settings.get("threads"), device=device
    )


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, allow_nan=True) + "\n", encoding="utf-8")


def _task(windows: str | Path, out: Path, reference: str | Path | None, settings: dict[str, Any]) -> dict:
    """A pass's task as JSON (what the engine process is handed): paths and the reference form."""
    return {
        "windows": str(windows),
        "out": str(out),
        "reference": None if reference is None else str(reference),
        "form": settings.get("reference_form", "full"),
        "top_k": settings.get("top_k"),
    }


def run_pass(
    model: str | Path, settings: dict[str, Any], kv: str, tasks: list[dict], preimage: dict | None, label: str
) -> dict[str, Any]:
    """One fresh engine over ``tasks`` (:func:`mixquant.kld.capture.score_pass`): in this process for hf, in
    a new Python process for vLLM (:func:`engine_process`). Writes each task's files into its ``out``."""
    spec = {"model": str(model), "kv_cache_dtype": kv, "tasks": tasks, "settings": settings}
    if settings["engine"]["engine"] != "vllm":
        return _pass_here(spec)
    return _pass_in_fresh_process(spec, preimage, label)


def _pass_in_fresh_process(spec: dict[str, Any], preimage: dict | None, label: str) -> dict[str, Any]:
    """A pass in a new Python process, its scratch beside the first task's output (the same filesystem)."""
    with _scratch(Path(spec["tasks"][0]["out"]).parent) as scratch:
        engine_process(spec, spec["settings"], preimage, scratch, label)
        return json.loads((scratch / PASS_JSON).read_text(encoding="utf-8"))


def _pass_here(spec: dict[str, Any]) -> dict[str, Any]:
    from mixquant.kld.capture import Reference, Task, load_windows, score_pass  # lazy: imports torch

    tasks = [
        Task(
            load_windows(t["windows"]),
            Path(t["out"]),
            None if t["reference"] is None else Reference(t["reference"]),
            t["form"],
            t["top_k"],
        )
        for t in spec["tasks"]
    ]
    settings = _engine_settings(spec["settings"], spec["kv_cache_dtype"])
    return score_pass(resolve_model_dir(spec["model"]), settings, tasks)


def run_reference_logits(
    out_dir: str | Path,
    *,
    model: str | Path,
    prompt: str | Path,
    settings: dict[str, Any],
    preimage: dict[str, Any],
) -> Path:
    """The BF16 model's reference on every window (BF16 KV cache); with ``captures`` > 1 also the noise
    floor of further fresh-engine captures.

    reference.json records, besides the hash and the engine, the numerics fingerprint the logits were
    computed under (top-level ``numerics``, mixquant.numerics): their hash is a numerical one, which
    ``mixquant verify`` expects to reproduce bit for bit only under an equal decisive fingerprint.
    """
    captures = int(settings.get("captures", 1))
    summary: dict[str, Any] = {}
    with publish_keyed_dir(out_dir, preimage, summary) as tmp:
        first = run_pass(
            model, settings, "bfloat16", [_task(prompt, tmp, None, settings)], preimage, "reference"
        )
        record, info = first["results"][0], first["engine"]
        noise = []
        for capture in range(1, captures):
            scratch = tmp / f".capture-{capture}"
            again = run_pass(
                model,
                settings,
                "bfloat16",
                [_task(prompt, scratch, tmp, settings)],
                preimage,
                f"capture {capture}",
            )
            noise.append(again["results"][0]["summary"])
            shutil.rmtree(scratch)
        if info.get("numerics") is None:  # an engine that does not record its own
            info = {**info, "numerics": fingerprint()}
        document = {
            "sha256": record["sha256"],
            "encoding": ENCODING,
            "shape": record["shape"],
            "positions": int(record["shape"][0]),
            "form": record["form"],
            "top_k": record["top_k"],
            "engine_settings": {**settings["engine"], "kv_cache_dtype": "bfloat16"},
            "engine": info,
            "numerics": info["numerics"],
            "captures": captures,
            "noise_floor": max(s["mean_kld"] for s in noise) if noise else None,
            "noise_captures": [{"mean_kld": s["mean_kld"], "max_kld": s["max_kld"]} for s in noise],
        }
        _write_json(tmp / REFERENCE_JSON, document)
        summary.update(sha256=record["sha256"], shape=record["shape"], seconds=round(first["seconds"], 3))
        summary.update(engine=info, noise_floor=document["noise_floor"])
    log.info("reference %s (%s), sha256 %s", tuple(record["shape"]), record["form"], record["sha256"])
    return Path(out_dir)


def run_kld(
    out_dir: str | Path,
    *,
    reference: str | Path,
    prompt: str | Path,
    candidate: str | Path,
    settings: dict[str, Any],
    preimage: dict[str, Any],
    suite_reference: str | Path | None = None,
    suite: str | Path | None = None,
) -> Path:
    """All ``settings["runs"]`` runs of one (candidate, KV dtype), each a fresh engine: KL(reference ||
    candidate) at every position of the prompt (and of the suite's windows), under ``runs/<i>/``."""
    runs = int(settings["runs"])
    if runs < 1:
        raise KldRunError(f"run_kld: runs must be at least 1, got {runs}")
    kv = settings["kv_cache_dtype"]
    means: list[float] = []
    summary: dict[str, Any] = {}
    with publish_keyed_dir(out_dir, preimage, summary) as tmp:
        for run in range(runs):
            target = run_dir(tmp, run)
            tasks = [_task(prompt, target, reference, {})]
            if suite is not None:
                tasks.append(_task(suite, target / SUITE_DIR, suite_reference, {}))
            result = run_pass(candidate, settings, kv, tasks, preimage, f"run {run}")
            for task, scored in zip(tasks, result["results"], strict=True):
                document = {
                    "run": run,
                    "kv_cache_dtype": kv,
                    "summary": scored["summary"],
                    "candidate_logits_sha256": scored["candidate_logits_sha256"],
                    "engine_settings": {**settings["engine"], "kv_cache_dtype": kv},
                    "engine": result["engine"],
                }
                _write_json(Path(task["out"]) / RUN_JSON, document)
            means.append(result["results"][-1]["summary"]["mean_kld"])
            log.info(
                "run %d (%s KV): mean KLD %s (engine pass %.2f s)",
                run,
                kv,
                ", ".join(f"{r['summary']['mean_kld']:.6g}" for r in result["results"]),
                result["seconds"],
            )
        summary.update(kv_cache_dtype=kv, runs=runs, mean_kld=means)
    return Path(out_dir)


@contextlib.contextmanager
def _scratch(beside: Path):
    """A fresh directory for a child's files (beside the output, on the same filesystem), always removed."""
    beside.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=".engine-", dir=beside))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


DONE_JSON = "done.json"  # the child's last write: its files and their SHA-256


def engine_process(
    spec: dict[str, Any],
    settings: dict[str, Any],
    preimage: dict[str, Any] | None,
    scratch: Path,
    label: str,
) -> list[str]:
    """Run one engine pass in a new Python process; the files it wrote (paths), checked.

    The child is ``python -m mixquant.kld.run SPEC`` (a module run under a ``__main__`` guard: vLLM starts its
    workers with ``spawn``, which re-imports the main module) in ``software.vllm_python`` when set, else this
    interpreter; mixquant comes from this process's copy (no env installs it), the environment is inherited
    (for vLLM without the CPU numerics profile: :func:`vllm_environment`), its output goes to this job's log.
    The child first checks its packages against the key (:func:`mixquant.keys.environments.check_software`),
    writes each task's files and ``pass.json`` into ``scratch``, and last ``done.json``: the pass is judged
    by its files against that list, not by the exit status (vLLM's teardown has been seen to abort after the
    output was complete: rc 134, "terminate called without an active exception").
    """
    software = settings.get("software") or {}
    python = software.get("python") or sys.executable
    spec = {**spec, "packages": (preimage or {}).get("packages"), "scratch": str(scratch)}
    package_root = str(Path(mixquant.__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    if settings["engine"]["engine"] == "vllm":
        env = vllm_environment(env)
    spec_path = scratch / "spec.json"
    _write_json(spec_path, spec)
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
        raise KldRunError(f"{label}: the engine process exited with {done.returncode}: {_last_line(output)}")
    if done.returncode != 0:
        log.warning(
            "%s: the engine process exited with %d after writing its complete output (checked against its "
            "done.json): accepted",
            label,
            done.returncode,
        )
    return files


def vllm_environment(env: dict[str, str]) -> dict[str, str]:
    """The engine process's environment for vLLM: without the CPU numerics profile of mixquant's stages.

    vLLM places itself and picks its own kernels by what the CPU has (its CPU build's BF16 GEMMs use
    oneDNN's AMX/AVX512 micro-kernels and abort under ONEDNN_MAX_CPU_ISA=AVX2) and its own threads; the
    profile pins torch's paths for what mixquant computes. The engine's fingerprint then records the host's
    native numerics; the KL statistics of a vLLM pass are computed in its process, natively.
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
        path = Path(name)
        if not path.is_file() or file_sha256(path) != sha:
            return None
    (scratch / DONE_JSON).unlink()
    return sorted(listed)


def run_engine_task(spec_path: str | Path) -> None:
    """The child of :func:`engine_process`: one pass, as the spec file describes."""
    spec = json.loads(Path(spec_path).read_text(encoding="utf-8"))
    settings, scratch = spec["settings"], Path(spec["scratch"])
    if spec.get("packages") is not None:  # the engine's own packages are the ones its key holds
        check_software({"packages": spec["packages"]}, settings.get("software"))
    result = _pass_here(spec)
    _write_json(scratch / PASS_JSON, result)
    written = [scratch / PASS_JSON] + [
        path for task in spec["tasks"] for path in sorted(Path(task["out"]).iterdir()) if path.is_file()
    ]
    _write_json(scratch / DONE_JSON, {"files": {str(path): file_sha256(path) for path in written}})


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


if __name__ == "__main__":  # the engine process (engine_process); vLLM's spawned workers skip this
    sys.exit(main())
