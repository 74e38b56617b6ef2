# KL-sensitivity placement search: score_sensitivity per macro-batch of calibration sequences (one streamed
# pass scores every MoE layer x format), then the solve_placement checkpoint (the placement under the bit
# budget: ILP or ModelOpt's threshold search), optionally refined by measured KL (refine_placement); the
# export follows the result.


rule score_sensitivity:
    input:
        unpack(keyed_inputs),
    output:
        scores=directory(f"{CFG.results_dir}/score_sensitivity/{{key}}"),
    log:
        f"{CFG.results_dir}/logs/score_sensitivity/{{key}}.log",
    benchmark:
        f"{CFG.results_dir}/benchmarks/score_sensitivity/{{key}}.tsv"
    wildcard_constraints:
        key="[0-9a-f]{64}",
    priority: SEARCH_PRIORITY
    conda:
        conda_env("score_sensitivity")
    threads: CFG.numerics.threads
    resources:
        mem_mb=keyed_request("mem_mb"),
        disk_mb=keyed_request("disk_mb"),
        runtime=keyed_request("runtime"),
        gpu=keyed_request("gpu"),
        nodes=keyed_request("nodes"),
    params:
        stage=keyed_params,
    script:
        "../scripts/run_stage.py"


if CFG.placement.source == "search":

    checkpoint solve_placement:
        input:
            unpack(
                lambda wildcards: {
                    role: str(ART[name].path)
                    for role, name in ART["placement"].upstream.items()
                }
            ),
        output:
            placement=report(
                directory(artifact_path("placement")),
                patterns=["{plot}.png", "{table}.csv"],
                caption="../report/placement.rst",
                category="Placement",
            ),
        log:
            stage_log("placement"),
        benchmark:
            stage_benchmark("placement")
        priority: SEARCH_PRIORITY
        conda:
            conda_env("solve_placement")
        threads: 1
        resources:
            mem_mb=artifact_request("placement", "mem_mb"),
            disk_mb=artifact_request("placement", "disk_mb"),
            runtime=artifact_request("placement", "runtime"),
            gpu=artifact_request("placement", "gpu"),
            nodes=artifact_request("placement", "nodes"),
        params:
            stage=stage_params("placement"),
        script:
            "../scripts/run_stage.py"


if "refined" in ART:

    checkpoint refine_placement:
        input:
            unpack(
                lambda wildcards: {
                    role: str(ART[name].path)
                    for role, name in ART["refined"].upstream.items()
                }
            ),
        output:
            placement=report(
                directory(artifact_path("refined")),
                patterns=["{plot}.png"],
                caption="../report/placement.rst",
                category="Placement",
            ),
        log:
            stage_log("refined"),
        benchmark:
            stage_benchmark("refined")
        conda:
            conda_env("refine_placement")
        threads: CFG.numerics.threads
        resources:
            mem_mb=artifact_request("refined", "mem_mb"),
            disk_mb=artifact_request("refined", "disk_mb"),
            runtime=artifact_request("refined", "runtime"),
            gpu=artifact_request("refined", "gpu"),
            nodes=artifact_request("refined", "nodes"),
        params:
            stage=stage_params("refined"),
        script:
            "../scripts/run_stage.py"


if "autoquantize" in ART:

    checkpoint autoquantize_placement:
        input:
            model=artifact_path("model"),
            calibration=artifact_path("calibration"),
        output:
            placement=directory(artifact_path("autoquantize")),
        log:
            stage_log("autoquantize"),
        benchmark:
            stage_benchmark("autoquantize")
        conda:
            conda_env("autoquantize_placement")
        threads: CFG.numerics.threads
        resources:
            mem_mb=artifact_request("autoquantize", "mem_mb"),
            disk_mb=artifact_request("autoquantize", "disk_mb"),
            runtime=artifact_request("autoquantize", "runtime"),
            gpu=artifact_request("autoquantize", "gpu"),
            nodes=artifact_request("autoquantize", "nodes"),
        params:
            stage=stage_params("autoquantize"),
        script:
            "../scripts/run_stage.py"
