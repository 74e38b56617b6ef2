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
