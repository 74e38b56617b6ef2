"""What a newcomer meets first: planning errors in one line from Snakemake; a failed stage shown as failed."""

import pytest


def _mixquant_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("mixquant:")]


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (
            lambda c: c["placement"]["search"].update(pins=[{"layers": "12", "format": "bf16"}]),
            "config key 'placement.search.pins.0.layers': layer 12 is not a MoE layer "
            "(the MoE layers are 1-8)",
        ),
        (
            lambda c: c.update(results_dir="../../etc"),
            "config key 'results_dir': '../../etc' is outside the working directory ('..' climbs out of it); "
            "set allow_outside_workdir: true to allow it",
        ),
        (
            lambda c: c["prompt"].update(seq_len=8192),
            "config key 'prompt.seq_len': 8192 tokens exceed the model's max_position_embeddings 4096",
        ),
        (
            lambda c: c["placement"].update(target_effective_bits=4.0),
            "config key 'placement.target_effective_bits': 4 is out of reach; feasible: 4.5..16",
        ),
    ],
)
def test_snakemake_stops_at_planning_with_one_line(workdir, edit, expected):
    config = workdir.config()
    config["model"] = {"source": "toy"}
    edit(config)
    name = workdir.write_config("config/bad.yaml", config)
    result = workdir.snakemake("-n", "--configfile", name, check=False)
    assert result.returncode != 0
    errors = _mixquant_lines(result)
    assert len(errors) == 1 and expected in errors[0], result.stderr
    plan = workdir.mixquant("plan", "--configfile", name, check=False)
    assert plan.returncode == 2 and plan.stderr.count("\n") == 1 and expected in plan.stderr, plan.stderr


def test_a_data_dir_symlinked_into_the_workdir_plans(workdir):
    # tests/workflow workdirs link data/ to the repo's: the corpus path stays inside the workdir
    assert (workdir.root / "data").is_symlink()
    config = workdir.config()
    config["model"] = {"source": "toy"}
    assert workdir.plan(workdir.write_config("config/toy.yaml", config))["build_toy_model"] == 1


@pytest.mark.slow
def test_a_failed_stage_is_failed_in_paths_and_the_run_says_where_to_look(workdir):
    """The toy's corpus pin fails at once (no training): a marker beside the log, `paths` says failed."""
    (workdir.root / "corpus.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    config = workdir.config()
    config["model"] = {"source": "toy"}
    config["dataset"]["local"]["path"] = "corpus.jsonl"  # the pinned sha256 is the committed corpus's
    name = workdir.write_config("config/bad-corpus.yaml", config)
    model = workdir.paths(name)["model"]
    assert model["state"] == "todo"
    result = workdir.snakemake(model["path"], "--configfile", name, check=False)
    assert result.returncode != 0
    assert "mixquant run stopped: `mixquant paths` shows which stages failed, and their logs" in (
        result.stderr
    )
    row = workdir.paths(name)["model"]
    assert (row["state"], row["done"]) == ("failed", False)
    log = workdir.root / row["log"]
    assert log.is_file() and "does not match the pinned" in log.with_suffix(".failed").read_text()
    text = workdir.mixquant("paths", "--configfile", name).stdout
    assert any(line.startswith("model ") and " failed " in line for line in text.splitlines())


def test_a_run_whose_jobs_would_run_elsewhere_than_their_keys_say_stops_before_any_job(workdir):
    """Keys planned for the conda envs (software.deployment: conda), Snakemake running the jobs in this venv:
    `snakemake -n` plans (the conda run's keys), a run stops at its start with one line naming the fix."""
    config = workdir.config()
    config["software"] = {"deployment": "conda"}
    name = workdir.write_config("config/conda.yaml", config)
    assert workdir.snakemake("-n", "--configfile", name).returncode == 0
    result = workdir.snakemake("--configfile", name, check=False)
    assert result.returncode != 0
    errors = _mixquant_lines(result)
    assert len(errors) == 1, result.stderr
    assert (
        "the keys name the conda environments of envs/ (software.deployment: conda) but Snakemake runs the "
        "jobs without conda: run with --sdm conda" in errors[0]
    )
    assert not (workdir.root / "results" / "fetch_model").exists()  # no job ran


def test_a_conda_profile_plans_the_conda_keys_where_conda_is_not_installed(workdir):
    """The toy (software.deployment: auto) under profiles/slurm-blackwell, on a machine without conda:
    `mixquant plan` plans with --sdm env-modules, and its jobs are the conda run's (paths --profile)."""
    import json

    profile = ("--profile", "profiles/slurm-blackwell")
    plan = json.loads(workdir.mixquant("plan", "--json", "--no-env-check", *profile).stdout)
    outputs = {output.rstrip("/") for job in plan["jobs"] for output in job["outputs"]}
    conda = json.loads(workdir.mixquant("paths", "--json", *profile).stdout)
    venv = workdir.paths()
    assert conda["calibration"]["env"] == "envs/quant.yaml" and venv["calibration"]["env"] == "venv"
    assert conda["calibration"]["path"] in outputs and venv["calibration"]["path"] not in outputs
    assert conda["model"]["key"] == venv["model"]["key"]  # a content pin: no package decides it


def _cuda_here() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(_cuda_here(), reason="this machine has CUDA: numerics.device: cuda plans and runs here")
def test_cuda_without_cuda_stops_planning_on_this_machine_but_plans_for_the_cluster(workdir):
    """numerics.device: cuda on a machine without CUDA: a local run stops before any job with one line
    naming the key and both fixes; the local plan still plans (planning needs neither weights nor a GPU),
    `snakemake -n` saying the same line as a warning and `mixquant plan` listing it as what stops the run;
    under a SLURM profile the jobs run on the cluster's GPU nodes, so this machine (a login node) plans
    them without a word."""
    import json

    import torch

    config = workdir.config()
    config["numerics"]["device"] = "cuda"
    name = workdir.write_config("config/cuda.yaml", config)
    reason = (
        f"torch {torch.__version__} here is built without CUDA"
        if not torch.backends.cuda.is_built()
        else "torch finds no CUDA device here"
    )
    expected = (
        f"config key 'numerics.device': 'cuda', but {reason}: set numerics.device: cpu, or run on a CUDA node"
    )
    result = workdir.snakemake("--cores", "1", "--configfile", name, check=False)
    assert result.returncode != 0
    errors = _mixquant_lines(result)
    assert len(errors) == 1 and expected in errors[0], result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert not (workdir.root / "results" / "fetch_model").exists()  # no job ran
    dry = workdir.snakemake("-n", "--configfile", name)
    warnings = [line for line in dry.stderr.splitlines() if expected in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: "), dry.stderr
    assert "quantize_layer" in dry.stdout
    plan = workdir.mixquant("plan", "--configfile", name)
    assert plan.stdout.count(expected) == 1 and "not ready to run" in plan.stdout, plan.stdout
    cluster = workdir.mixquant(
        "plan", "--json", "--no-env-check", "--profile", "profiles/slurm-blackwell", "--configfile", name
    )
    jobs = json.loads(cluster.stdout)["jobs"]
    assert {job["resources"]["gpu"] for job in jobs if job["rule"] == "quantize_layer"} == {"1"}


def test_the_vllm_engine_without_vllm_stops_the_run_before_any_job_pointing_at_the_serve_env(workdir):
    """kld.engine: vllm in this venv, without vLLM and without software.vllm_python: `mixquant plan` lists it
    as what stops the run, and a run stops at its start, naming envs/serve.yaml (--sdm conda), never a pip
    extra (vLLM pins its own torch: it cannot install beside mixquant's)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is importable here")
    config = workdir.config()
    config["kld"]["engine"] = "vllm"
    name = workdir.write_config("config/vllm.yaml", config)
    expected = (
        "config key 'kld.engine': vllm, but vLLM is not importable here and software.vllm_python is not set: "
        "run with --sdm conda (the vLLM stages then run in envs/serve.yaml), or set software.vllm_python"
    )
    plan = workdir.mixquant("plan", "--no-env-check", "--configfile", name).stdout
    assert f"  - {expected}" in plan
    result = workdir.snakemake("--configfile", name, check=False)
    assert result.returncode != 0
    errors = _mixquant_lines(result)
    assert len(errors) == 1 and expected in errors[0], result.stderr
    assert "pip install" not in result.stderr
    assert not (workdir.root / "results" / "fetch_model").exists()  # no job ran


def test_a_hub_model_without_geometry_says_what_the_plan_cannot_estimate(workdir):
    """Without model.geometry the plan has no estimates and every job the same fallback request: the plan
    (`mixquant plan`, `snakemake -n`) says so, why, and how to fix it."""
    config = workdir.config("config/laguna-s-2.1.yaml")
    del config["model"]["geometry"]
    config["numerics"]["device"] = "cpu"
    name = workdir.write_config("config/no-geometry.yaml", config)
    expected = (
        "model.geometry is not set (hub model poolside/Laguna-S-2.1 at revision "
        f"{config['model']['hub']['revision']}): without the model's config.json planning estimates no "
        "memory, time or disk, and every job requests the same mem_mb=4000, runtime=60, disk_mb=50000"
    )
    plan = workdir.mixquant(
        "plan", "--no-env-check", "--profile", "profiles/slurm-blackwell", "--configfile", name
    )
    warnings = [line for line in plan.stdout.splitlines() if line.startswith("warning: model.geometry")]
    assert len(warnings) == 1 and warnings[0].startswith(f"warning: {expected}"), plan.stdout
    assert "set model.geometry to a copy of the pinned revision's config.json" in warnings[0]
    assert "Estimates" not in plan.stdout  # nothing estimated, and now it says why
    dry = workdir.snakemake(
        "-n", "--profile", "profiles/slurm-blackwell", "--sdm", "env-modules", "--configfile", name
    )
    assert f"warning: {expected}" in dry.stderr


def test_a_run_in_a_busy_workdir_stops_with_the_holders_line_only(workdir):
    """Another live run holds this working directory (its owner record, as a run writes it at its start): a
    run stops with the one line naming it, before Snakemake's lock error and its advice to --unlock (which
    would break the live run); a dry run still plans and names the holder."""
    import json
    import socket
    import subprocess
    from pathlib import Path

    holder = subprocess.Popen(["sleep", "120"])
    try:
        start = Path(f"/proc/{holder.pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
        owner = {"pid": holder.pid, "host": socket.gethostname(), "start": start}
        (workdir.root / ".snakemake").mkdir()
        (workdir.root / ".snakemake" / "mixquant-run.json").write_text(json.dumps(owner))
        line = (
            f"mixquant: this working directory is in use by the run of pid {holder.pid} on "
            f"{socket.gethostname()}; wait for it or stop it (snakemake --unlock only once it is gone)"
        )
        result = workdir.snakemake(check=False)
        assert result.returncode != 0
        assert _mixquant_lines(result) == [line], result.stderr
        assert "LockException" not in result.stderr + result.stdout
        assert "Traceback" not in result.stderr + result.stdout
        assert not (workdir.root / "results").exists()  # no job ran
        dry = workdir.snakemake("-n")
        assert line in dry.stderr.splitlines()
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.slow
def test_ctrl_c_ends_with_one_line_and_the_tracebacks_in_the_logs(workdir):
    """A Ctrl-C (SIGINT to the run's whole process group, as a terminal sends it) while a job runs: after
    it the console holds one line, no traceback and no 'failed' stage; the job's traceback is in its log
    and Snakemake's account in its log; a rerun plans the rest, nothing locked.

    The job is caught mid-stage at a fault point (mixquant.faults: sample_calibration's files written, not
    yet published), where it stops itself; the SIGINT goes to the whole group and the job is then let go,
    so that the signal always finds it computing (a timed wait could find it already done)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from mixquant.faults import MARK_ENV, POINT_ENV

    console = workdir.root / "console.txt"
    mark = workdir.root / "fault.mark"
    env = os.environ | {POINT_ENV: "files-written@sample_calibration", MARK_ENV: str(mark)}
    with open(console, "w") as out:
        run = subprocess.Popen(
            # one job at a time: only the stopped job is running when the signal goes out
            [sys.executable, "-m", "snakemake", "--cores", "1"],
            cwd=workdir.root,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, as a terminal's foreground job
        )
        try:
            deadline = time.monotonic() + 300
            while not mark.is_file():
                assert run.poll() is None and time.monotonic() < deadline, console.read_text()[-3000:]
                time.sleep(0.1)
            job = int(mark.read_text().split()[0])
            before = len(console.read_text().splitlines())
            os.killpg(run.pid, signal.SIGINT)
            os.kill(job, signal.SIGCONT)  # the pending SIGINT reaches it as it goes on with its stage
            assert run.wait(timeout=300) != 0
        finally:
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
    lines = console.read_text().splitlines()
    after = lines[before:]
    assert len(after) == 1, after  # ours, nothing of Snakemake's
    assert lines[-1].startswith("mixquant: interrupted; rerun the same command to resume"), lines[-5:]
    text = "\n".join(lines)
    for noise in ("Traceback", "KeyboardInterrupt", "Error in rule", "failed", "--unlock"):
        assert noise not in text, noise
    interrupted = [
        log.parent.name
        for log in (workdir.root / "results" / "logs").glob("*/*.log")
        if "KeyboardInterrupt" in log.read_text()
    ]
    assert interrupted == ["sample_calibration"], "the stopped job's log holds its traceback"
    (snakemake_log,) = (workdir.root / ".snakemake" / "log").glob("*.snakemake.log")
    assert all(f"Error in rule {stage}" in snakemake_log.read_text() for stage in interrupted)
    assert str(snakemake_log.name) in lines[-1]
    rerun = workdir.snakemake("-n")
    assert "sample_calibration" in rerun.stdout and "LockException" not in rerun.stderr
