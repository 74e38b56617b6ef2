"""Planning without running: both configs plan, and bad configs fail with one line naming the key."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml
from mixquant.model.families import architecture

LAGUNA = "config/laguna-s-2.1.yaml"  # numerics.device: cuda: its jobs run on the GPU nodes of slurm-blackwell

# Up to the solve_placement checkpoint: the rebuild of the placement and the export are planned once
# Snakemake has the placement (they appear in the plan of a later run).
TOY_DAG = {
    "fetch_model": 1,  # the shipped toy (data/toy-laguna), pinned by content: nothing trains
    "sample_calibration": 1,
    "pin_prompt": 1,
    "collect_activation_stats": 1,
    "quantize_layer": 2,  # one window per format, every MoE layer in NVFP4 and in FP8: what the search scores
    "score_sensitivity": 2,  # 2 streamed passes of 32 sequences, each scoring every (layer, format)
    "solve_placement": 1,
    # the evaluation suite's windows, and the references of the prompt and of the suite
    "sample_eval": 1,
    "reference_logits": 2,
    # KLD of what does not depend on a placement: the uniform-NVFP4 candidate (its export reuses the
    # search's NVFP4 layer results) and the BF16 self-check, 2 KV dtypes each (5 runs per job), and gates
    "export_checkpoint": 1,
    "run_kld": 4,
    "gate_kld": 4,
}


def test_default_config_plans_the_toy_dag(workdir):
    assert workdir.plan() == TOY_DAG


def test_explicit_placement_plans_the_rebuild_and_export_up_front(workdir):
    """With the explicit placement the whole DAG is known up front."""
    config = workdir.config()
    config["placement"]["source"] = "explicit"
    assert workdir.plan(workdir.write_config("config/explicit.yaml", config)) == {
        "fetch_model": 1,
        "sample_calibration": 1,
        "pin_prompt": 1,
        "sample_eval": 1,
        "collect_activation_stats": 1,
        "quantize_layer": 3,  # one window per format placed (NVFP4 also covers the uniform candidate)
        "export_checkpoint": 2,  # the placement's and the uniform-NVFP4 candidate's
        "reference_logits": 2,  # the prompt's and the suite's
        "run_kld": 6,  # 3 candidates x 2 KV dtypes, 5 fresh-engine runs in each job
        "gate_kld": 6,
        "kld_report": 1,
        "check_kld_gates": 1,
        "verify_hashes": 1,
        "assemble_release": 1,
    }


def test_reference_config_plans_without_weights(workdir):
    """On the cluster profile its CUDA jobs run on (this machine plans them; it need not have CUDA)."""
    out = workdir.mixquant(
        "plan", "--json", "--no-env-check", "--profile", "profiles/slurm-blackwell", "--configfile", LAGUNA
    )
    assert {rule: row["jobs"] for rule, row in json.loads(out.stdout)["rules"].items()} == {
        "sample_calibration": 1,
        "pin_prompt": 1,
        "collect_activation_stats": 1,
        "quantize_layer": 94,  # 47 MoE layers x (NVFP4, FP8)
        "score_sensitivity": 2,  # 2 streamed passes, each scoring every (layer, format) on 256 sequences
        "solve_placement": 1,
        "fetch_model": 2,  # the BF16 model and the pinned baseline checkpoint
        "sample_eval": 1,  # the evaluation suite: 123 windows of 2,048 tokens
        "reference_logits": 2,  # the prompt's and the suite's
        "run_kld": 2,  # the baseline, 2 KV dtypes (5 runs each); the searched candidate's follow the solve
        "gate_kld": 2,
    }
    paths = workdir.paths("config/laguna-s-2.1.yaml")
    assert paths["model"]["path"].startswith("results/fetch_model/")
    assert not any(row["done"] for row in paths.values())


def test_reference_config_is_not_mixed_with_the_default(workdir):
    # Snakemake merges --configfile over the Snakefile's default; mixquant uses the given file alone.
    toy = workdir.paths()
    real = workdir.paths("config/laguna-s-2.1.yaml")
    assert toy["calibration"]["key"] != real["calibration"]["key"]
    result = workdir.snakemake(
        "-n", "--profile", "profiles/slurm-blackwell", "--sdm", "env-modules", "--configfile", LAGUNA
    )
    assert real["calibration"]["path"] in result.stdout + result.stderr


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (
            lambda c: c["calibration"].update(num_sampels=3),
            "unknown config key 'calibration.num_sampels'; did you mean 'calibration.num_samples'?",
        ),
        (lambda c: c["calibration"].update(num_samples="many"), "config key 'calibration.num_samples'"),
        (lambda c: c.update(calibraton={}), "unknown config key 'calibraton'; did you mean 'calibration'?"),
        (lambda c: c["dataset"]["local"].update(sha256="xyz"), "config key 'dataset.local.sha256'"),
        (
            lambda c: c["model"]["toy"]["arch"].update(hidden_sise=64),
            "unknown config key 'model.toy.arch.hidden_sise'",
        ),
    ],
)
def test_bad_config_fails_with_one_line_naming_the_key(workdir, edit, expected):
    config = workdir.config()
    config["model"]["toy"].setdefault("arch", {})
    edit(config)
    name = workdir.write_config("config/bad.yaml", config)
    result = workdir.snakemake("-n", "--configfile", name, check=False)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("mixquant:")]
    assert len(errors) == 1 and expected in errors[0], result.stderr
    cli = workdir.mixquant("paths", "--configfile", name, check=False)
    assert cli.returncode == 2 and expected in cli.stderr and len(cli.stderr.strip().splitlines()) == 1


def test_unpinned_real_model_is_refused_at_config_time_only_for_remote_code(workdir):
    config = workdir.config("config/laguna-s-2.1.yaml")
    config["model"]["hub"]["revision"] = None
    config["model"]["trust_remote_code"] = True
    name = workdir.write_config("config/unpinned.yaml", config)
    result = workdir.mixquant("paths", "--configfile", name, check=False)
    assert (
        result.returncode == 2
        and "trust_remote_code needs a hub source with a pinned revision" in result.stderr
    )


LAGUNA_PLAN = {
    "sample_calibration": 1,
    "pin_prompt": 1,
    "collect_activation_stats": 1,
    "quantize_layer": 94,
    "score_sensitivity": 2,  # 512 sequences in 2 streamed passes of 256 (the B200's memory)
    "solve_placement": 1,
    "fetch_model": 2,
    "sample_eval": 1,  # the evaluation suite: 123 windows of 2,048 tokens over three domains
    "reference_logits": 2,  # the pinned prompt's and the suite's (top-k form, 2 captures)
    "run_kld": 2,
    "gate_kld": 2,
}


def test_laguna_dry_run_under_the_slurm_profile(workdir):
    # no SLURM and no weights here; without conda the sdm is switched off (README)
    result = workdir.snakemake(
        "-n",
        "--profile",
        "profiles/slurm-blackwell",
        "--sdm",
        "env-modules",
        "--configfile",
        "config/laguna-s-2.1.yaml",
    )
    counts = {}
    for rule in re.findall(r"^(?:local)?(?:rule|checkpoint) (\w+):$", result.stdout, re.M):
        counts[rule] = counts.get(rule, 0) + 1
    assert counts == {**LAGUNA_PLAN, "all": 1}


# Stages that compute on numerics.device (cuda in config/laguna-s-2.1.yaml), one GPU each; the KLD stages
# serve the model with vLLM at tensor_parallel_size 4.
DEVICE_RULES = ("collect_activation_stats", "quantize_layer", "score_sensitivity")
ENGINE_RULES = ("reference_logits", "run_kld")


def test_laguna_plan_lists_every_job_with_resources_and_estimates_every_stage(workdir):
    out = workdir.mixquant(
        "plan",
        "--json",
        "--no-env-check",  # test_laguna_plan_says_whether_each_conda_env_resolves
        "--profile",
        "profiles/slurm-blackwell",
        "--configfile",
        "config/laguna-s-2.1.yaml",
    )
    plan = json.loads(out.stdout)
    assert {rule: row["jobs"] for rule, row in plan["rules"].items()} == LAGUNA_PLAN
    jobs = plan["jobs"]
    assert len(jobs) == sum(LAGUNA_PLAN.values())
    for job in jobs:
        assert job["reason"].startswith("Missing output files"), job
        resources = job["resources"]
        assert int(resources["mem_mb"]) >= 2000 and int(resources["runtime"]) >= 10, job
        gpus = {**dict.fromkeys(DEVICE_RULES, "1"), **dict.fromkeys(ENGINE_RULES, "4")}.get(job["rule"], "0")
        assert resources["gpu"] == gpus and resources["nodes"] == "1", job
        # what the SLURM plugin submits: the partition its partition file picks, one node, the GPUs
        options = job["sbatch"].split()
        assert options[options.index("-p") + 1] == ("gpu" if gpus != "0" else "cpu"), job
        assert "--nodes=1" in options and (f"--gpus={gpus}" in options) == (gpus != "0"), job
        assert not any(option.startswith("--gpus") for option in options) or gpus != "0", job
    # streamed: no job holds the BF16 model (~236 GB); a forward job holds about two layers and its states
    by_rule = {job["rule"]: job["resources"] for job in jobs}
    assert all(int(by_rule[rule]["mem_mb"]) <= 64 * 1024 for rule in by_rule)

    rows = {(row["stage"], row["after_solve"]): row for row in plan["estimates"]}
    for rule, count in LAGUNA_PLAN.items():
        assert rows[(rule, False)]["jobs"] == count, rule
    # after the solve, with placement.explicit (39/3/5) standing in: the 5 BF16 layers, the export and
    # the searched candidate's 2 run jobs (5 runs each), its 2 gates, the report and the verdict
    later = {stage: row["jobs"] for (stage, after), row in rows.items() if after}
    assert later == {
        "quantize_layer": 5,
        "export_checkpoint": 1,
        "run_kld": 2,
        "gate_kld": 2,
        "kld_report": 1,
        "check_kld_gates": 1,
        "verify_hashes": 1,
        "assemble_release": 1,
    }
    for (stage, _), row in rows.items():
        assert (row["gpu_hours"] > 0) == (stage in DEVICE_RULES + ENGINE_RULES), stage
        assert row["peak_host_bytes"] > 0 and row["bytes_read"] + row["bytes_written"] > 0, stage
    assert rows[("fetch_model", False)]["bytes_written"] > 236e9  # BF16 model + the baseline checkpoint
    assert 0.9 * 92.4e9 < rows[("export_checkpoint", True)]["bytes_written"] < 1.1 * 92.5e9
    text = workdir.mixquant(
        "plan",
        "--jobs",
        "--no-env-check",
        "--profile",
        "profiles/slurm-blackwell",
        "--configfile",
        "config/laguna-s-2.1.yaml",
    ).stdout
    assert "| export_checkpoint (after solve) | 1 |" in text and "gpu=4" in text
    assert "Critical path (64 jobs at once):" in text
    assert re.search(r"^  reference_logits +1 x  -p gpu .*--nodes=1 .*--gpus=4$", text, re.M), text
    assert re.search(r"^  quantize_layer +47 x  -p gpu .*--nodes=1 .*--gpus=1$", text, re.M), text
    assert re.search(
        r"^  sample_calibration +1 x  -p cpu .*--nodes=1 --ntasks=1 --cpus-per-task=2$", text, re.M
    )
    # it ends with what stops the run: the unpinned dataset revisions and the prompt only the user has
    tail = text[text.index("not ready to run") :].splitlines()
    assert tail[0] == "not ready to run: 2 things will stop the run"
    assert tail[1].startswith("  - dataset.hub[0].revision") and "not pinned" in tail[1]
    assert tail[2].startswith(
        "  - prompt.token_ids_file: data/prompts/laguna-s-2.1-prompt.safetensors does not"
    )
    assert len(tail) == 3


def test_a_cpu_config_on_the_slurm_profile_asks_for_no_gpu(workdir):
    """numerics.device: cpu and the hf engine on the GPU cluster's profile: every job to the CPU partition,
    none with a GPU; and the toy, whose inputs are all here, is ready to run."""
    plan = json.loads(
        workdir.mixquant("plan", "--json", "--no-env-check", "--profile", "profiles/slurm-blackwell").stdout
    )
    for job in plan["jobs"]:
        assert job["resources"]["gpu"] == "0", job
        assert " -p cpu " in f" {job['sbatch']} " and "--gpus" not in job["sbatch"], job
    assert plan["ready"] is True and plan["blockers"] == []


def _laguna_slurm_plan(workdir, *config: str) -> dict:
    args = ("--no-env-check", "--profile", "profiles/slurm-blackwell", "--configfile", LAGUNA)
    return json.loads(workdir.mixquant("plan", "--json", *args, *config).stdout)


def test_laguna_plan_meets_the_gpu_scale_targets(workdir):
    """docs/cost-model.md's Laguna-S-2.1 on slurm-blackwell: every forward stage on the GPU partition,
    at most 64 GB of host memory per job, sensitivity within 1 GPU-hour, the pipeline within 10 GPU-hours
    and 50 CPU core-hours (as allocated), a critical path within 3 hours -- with the evaluation suite (the
    config as shipped: 123 windows of 2,048 tokens, a top-k reference, 2 captures) and without it (the
    pinned prompt alone, as the release measured it). The suite fits because the vLLM engine applies its
    off-engine lm_head and computes the KL statistics on the job's first GPU (mixquant.kld.vllm_engine,
    mixquant.kld.capture), not on the job's one CPU thread."""
    plan = _laguna_slurm_plan(workdir)
    for job in plan["jobs"]:
        if job["rule"] in DEVICE_RULES + ENGINE_RULES:
            assert " -p gpu " in f" {job['sbatch']} " and int(job["resources"]["gpu"]) >= 1, job
    rows = plan["estimates"]
    assert max(row["peak_host_bytes"] for row in rows) <= 64e9
    sensitivity = sum(row["gpu_hours"] for row in rows if row["stage"] == "score_sensitivity")
    assert 0 < sensitivity <= 1.0
    assert sum(row["gpu_hours"] for row in rows) <= 10.0
    assert sum(row["cpu_hours"] for row in rows) <= 50.0
    critical = plan["critical_path"]
    assert 0 < critical["seconds"] <= 3 * 3600 and critical["slots"] == 64
    assert critical["chain"][0] == "model" and critical["chain"][-1] == "release"
    suite = [row for row in rows if row["stage"] in ("sample_eval", "reference_logits", "run_kld")]
    assert {row["stage"] for row in suite} == {"sample_eval", "reference_logits", "run_kld"}

    prompt_only = _laguna_slurm_plan(workdir, "--config", "kld={eval: null}")
    rows = prompt_only["estimates"]
    assert "sample_eval" not in {row["stage"] for row in rows}
    assert max(row["peak_host_bytes"] for row in rows) <= 64e9
    assert sum(row["gpu_hours"] for row in rows) <= 10.0
    assert sum(row["cpu_hours"] for row in rows) <= 50.0
    critical = prompt_only["critical_path"]
    assert 0 < critical["seconds"] <= 3 * 3600 and critical["slots"] == 64
    # the chain runs through the search and then the placed rebuild: the solve gates the export
    chain = critical["chain"]
    assert chain[0] == "model" and chain[-1] == "release" and "placement" in chain
    assert chain.index("placement") < chain.index("checkpoint")


# Real models of the other families (config/<name>.yaml, geometry in data/models/<name>/config.json): the
# published parameter count, the model type, whether the source is published in block FP8.
FAMILY_CONFIGS = {
    "qwen3-235b-a22b": (235_093_634_560, "qwen3_moe", False),
    "deepseek-v3": (671_026_419_200, "deepseek_v3", True),  # 671B, the MTP layer apart
    "glm-4.6": (352_797_829_024, "glm4_moe", False),  # 355B with the MTP layer, which is not loaded
    "minimax-m2": (228_689_764_864, "minimax_m2", True),
}


@pytest.mark.parametrize("name", sorted(FAMILY_CONFIGS))
def test_each_family_plans_and_predicts_from_its_committed_geometry(workdir, name):
    params, model_type, fp8_source = FAMILY_CONFIGS[name]
    configfile = f"config/{name}.yaml"
    args = ("--no-env-check", "--profile", "profiles/slurm-blackwell", "--configfile", configfile)
    plan = json.loads(workdir.mixquant("plan", "--json", *args).stdout)
    rules = set(plan["rules"])
    assert {"fetch_model", "collect_activation_stats", "quantize_layer", "score_sensitivity"} <= rules
    assert ("dequantize_source" in rules) == fp8_source
    stages = {row["stage"] for row in plan["estimates"]}
    assert {"score_sensitivity", "export_checkpoint", "run_kld"} <= stages
    assert plan["critical_path"]["seconds"] > 0 and plan["critical_path"]["chain"][-1] == "release"
    arch = architecture(workdir.root / "data" / "models" / name / "config.json")
    assert arch.model_type == model_type
    moe = len(arch.moe_layers)
    geometry = f"data/models/{name}/config.json"
    predict = ("predict", "--model-config", geometry, "--json")
    # KV-cache scales are Laguna's only: none by default, refused when asked for
    fp8_kv = workdir.mixquant(
        *predict, "--kv-cache-quant", "FP8", "--placement-counts", f"fp8={moe}", check=False
    )
    assert fp8_kv.returncode == 2 and fp8_kv.stdout == ""
    assert (
        fp8_kv.stderr.strip()
        == f"mixquant: --kv-cache-quant FP8: KV-cache scales are not supported for {model_type}"
    )
    # counts must cover every MoE layer: the one-line error names how many there are
    short = workdir.mixquant(*predict, "--placement-counts", "nvfp4_w4a16=2,fp8=1", check=False)
    assert short.returncode == 2 and short.stdout == ""
    assert short.stderr.strip() == f"mixquant: placement counts sum to 3, but the model has {moe} MoE layers"
    counts = f"nvfp4_w4a16={moe - 3},fp8=2,bf16=1"
    prediction = json.loads(workdir.mixquant(*predict, "--placement-counts", counts).stdout)
    assert prediction["parameters"]["total"] == params
    assert prediction["model"]["model_type"] == model_type
    projections = 3 * arch.num_experts
    assert prediction["tensors"]["routed"] == {
        "nvfp4_w4a16": 3 * projections * (moe - 3),
        "fp8": 3 * projections * 2,
        "bf16": projections,
    }
    bits = (4.5 * (moe - 3) + 8 * 2 + 16) / moe
    assert prediction["routed_effective_bits"] == pytest.approx(bits)
    assert prediction["tensors"]["kv_scales"] == 0


def test_kv_cache_scales_outside_laguna_stop_planning_in_one_line(workdir):
    config = yaml.safe_load((workdir.root / "config" / "qwen3-235b-a22b.yaml").read_text())
    config["export"]["kv_cache_quant"] = "fp8"
    configfile = workdir.root / "qwen3-fp8-kv.yaml"
    configfile.write_text(yaml.safe_dump(config))
    result = workdir.mixquant("plan", "--configfile", str(configfile), check=False)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"mixquant: {configfile}: config key 'export.kv_cache_quant': 'fp8', but KV-cache scales are "
        "supported for laguna only (set it to null for qwen3_moe)"
    )


def test_nested_config_overrides_take_the_numbers_they_name(workdir):
    """`--config 'section={key: value}'` (how Snakemake takes a nested key; YAML hands the value over as
    a string) gives the same keys as a config file with the number; a value that is not one is one line."""
    config = workdir.config()
    config["calibration"]["num_samples"] = 8
    configfile = workdir.write_config("eight.yaml", config)

    def sample_calibration_dir(*args: str) -> str:
        text = workdir.snakemake("-n", *args).stdout
        return re.search(r"results/sample_calibration/[0-9a-f]{64}", text).group(0)

    nested = sample_calibration_dir("--config", 'calibration={num_samples: "8"}')
    assert nested == sample_calibration_dir("--configfile", configfile)
    assert nested != sample_calibration_dir()
    bad = workdir.snakemake("-n", "--config", "calibration={num_samples: eight}", check=False)
    assert bad.returncode != 0
    assert bad.stderr.strip().splitlines()[-1] == (
        "mixquant: config/config.yaml with --config calibration: config key 'calibration.num_samples': "
        "Input should be a valid integer, unable to parse string as an integer (got 'eight')"
    )


@pytest.mark.network
def test_laguna_plan_says_whether_each_conda_env_resolves(workdir, env_resolutions):
    """Under conda, the plan lists each env the jobs run in, whether pip's resolver resolves it (the session's
    resolutions, seeded into this workdir's cache as `mixquant plan` itself would have made them) and the
    stages that use it; the keys are the conda run's even where conda is not installed."""
    cache, resolutions = env_resolutions
    shutil.copytree(cache, workdir.root / ".snakemake" / "mixquant-envs")
    args = ("--profile", "profiles/slurm-blackwell", "--configfile", "config/laguna-s-2.1.yaml")
    plan = json.loads(workdir.mixquant("plan", "--json", *args).stdout)
    rows = {row["env"]: row for row in plan["environments"]}
    assert set(rows) == {"envs/quant.yaml", "envs/serve.yaml"}
    assert rows["envs/serve.yaml"]["stages"] == ["reference_logits", "run_kld"]
    assert "quantize_layer" in rows["envs/quant.yaml"]["stages"]
    assert "run_kld" not in rows["envs/quant.yaml"]["stages"]
    for name, row in rows.items():
        assert row["status"] == resolutions[name.split("/")[1].removesuffix(".yaml")].status == "resolves"
    assert "vllm 0.33.0" in rows["envs/serve.yaml"]["detail"]
    text = workdir.mixquant("plan", *args).stdout
    assert "  envs/serve.yaml  resolves: 198 packages (vllm 0.33.0, torch 2.14.0" in text
    assert "used by reference_logits, run_kld" in text
    paths = workdir.paths("config/laguna-s-2.1.yaml")
    outputs = {output.rstrip("/") for job in plan["jobs"] for output in job["outputs"]}
    assert paths["reference_logits"]["path"] in outputs  # snakemake -n planned the keys `paths` shows


def test_laguna_plan_without_the_package_index_says_not_checked(workdir):
    env = {"PIP_INDEX_URL": "http://127.0.0.1:9/simple"}  # nothing listens there
    args = ("--profile", "profiles/slurm-blackwell", "--configfile", "config/laguna-s-2.1.yaml")
    result = subprocess.run(
        [sys.executable, "-m", "mixquant.cli", "plan", *args],
        cwd=workdir.root,
        capture_output=True,
        text=True,
        env={**os.environ, **env},
    )
    assert result.returncode == 0, result.stderr
    assert (
        "envs/quant.yaml  not checked: no network: http://127.0.0.1:9/simple is not reachable"
        in result.stdout
    )


def test_paths_shows_the_env_and_the_versions_each_key_holds(workdir):
    """The reference release's keys name the conda envs its jobs run in: the serve env's vLLM and torch for
    the vLLM stages, the quant env's for the rebuild; the toy's, this venv's."""
    from mixquant.keys.environments import env_path, installed_versions, read_env_file

    paths = workdir.paths("config/laguna-s-2.1.yaml")
    serve, quant = (read_env_file(env_path(name)) for name in ("serve", "quant"))
    reference = paths["reference_logits"]
    assert reference["env"] == "envs/serve.yaml"
    assert reference["packages"]["vllm"] == serve.pins["vllm"] and reference["packages"]["torch"] == "2.14.0"
    layer = next(row for row in paths.values() if row["stage"] == "quantize_layer")
    assert layer["env"] == "envs/quant.yaml" and layer["packages"]["torch"] == quant.pins["torch"] == "2.13.0"
    toy = workdir.paths()
    assert toy["reference_logits"]["env"] == "venv"
    assert toy["reference_logits"]["packages"]["torch"] == installed_versions(("torch",))["torch"]


def test_paths_and_a_run_with_the_same_config_overrides_plan_the_same_keys(workdir):
    """`mixquant paths --config ...` shows the keys `snakemake --config ...` plans; a --configfile run
    reads that file alone, without Snakemake's note that it extends config/config.yaml."""
    override = ("--config", "placement={target_effective_bits: 5.0}")
    paths = json.loads(workdir.mixquant("paths", "--json", *override).stdout)
    assert paths["placement"]["key"] != workdir.paths()["placement"]["key"]
    run = workdir.snakemake("-n", *override)
    assert paths["placement"]["path"] in run.stdout
    alone = workdir.snakemake("-n", "--configfile", workdir.write_config("other.yaml", workdir.config()))
    assert "is extended by additional config" not in alone.stdout + alone.stderr
    assert paths["calibration"]["path"] in alone.stdout


def test_plan_names_each_job_and_the_gpu_its_estimates_assume(workdir):
    text = workdir.mixquant("plan", "--jobs", "--no-env-check").stdout
    names = [match.group(1) for match in re.finditer(r"^(\S.*?) +[0-9a-f]{12}  ", text, re.M)]
    assert "quantize_layer nvfp4_w4a16 layers 1-8" in names and "quantize_layer fp8 layers 1-8" in names
    assert {"run_kld bf16 kv fp8", "gate_kld uniform-nvfp4 kv bfloat16", "fetch_model"} <= set(names)
    assert len(names) == sum(TOY_DAG.values())
    assert "they assume one HGX B200 GPU (179 GiB) per GPU job" in text


def test_laguna_plan_with_gptq_rounding_and_refinement_stays_within_the_bounds(workdir):
    """GPTQ rounding (the experts' calibration inputs, 1.6 GB per MoE layer; each NVFP4 layer's experts
    rounded in batches on its GPU) and the refinement (8 candidates on 16 held-out sequences) keep the
    Laguna-S-2.1 plan within 10 GPU-hours, 50 CPU core-hours and a 3-hour critical path."""
    plain = _laguna_slurm_plan(workdir)
    plan = _laguna_slurm_plan(
        workdir,
        "--config",
        "quantize={nvfp4_w4a16: {rounding: gptq}}",
        "placement={search: {refine: {candidates: 8, holdout_samples: 16}}}",
    )
    rows = {row["stage"]: row for row in plan["estimates"] if not row["after_solve"]}
    assert {"collect_expert_inputs", "refine_placement"} <= set(plan["rules"])
    before = {row["stage"]: row for row in plain["estimates"] if not row["after_solve"]}
    assert rows["quantize_layer"]["gpu_hours"] > before["quantize_layer"]["gpu_hours"]  # GPTQ is counted
    assert rows["collect_expert_inputs"]["bytes_written"] > 70e9  # 47 layers x 1.6 GB of expert inputs
    for job in plan["jobs"]:
        if job["rule"] in ("collect_expert_inputs", "refine_placement", "quantize_layer"):
            assert " -p gpu " in f" {job['sbatch']} ", job
    estimates = plan["estimates"]
    assert max(row["peak_host_bytes"] for row in estimates) <= 64e9
    assert sum(row["gpu_hours"] for row in estimates) <= 10.0
    assert sum(row["cpu_hours"] for row in estimates) <= 50.0
    assert 0 < plan["critical_path"]["seconds"] <= 3 * 3600
