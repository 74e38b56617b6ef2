# Rebuild from BF16: activation statistics, then one quantize_layer job per (format, fixed window of
# quantize.layers_per_job MoE layers), keyed by what its layers depend on (model, layers, format, params;
# + activation stats for FP8, + the experts' calibration inputs for GPTQ rounding), never by the placement;
# export and scoring read its layer_<L>/ subdirs.


rule collect_activation_stats:
    input:
        model=artifact_path("model"),
        calibration=artifact_path("calibration"),
    output:
        activations=directory(artifact_path("activations")),
    log:
        stage_log("activations"),
    benchmark:
        stage_benchmark("activations")
    priority: SEARCH_PRIORITY
    conda:
        conda_env("collect_activation_stats")
    threads: CFG.numerics.threads
    resources:
        mem_mb=artifact_request("activations", "mem_mb"),
        disk_mb=artifact_request("activations", "disk_mb"),
        runtime=artifact_request("activations", "runtime"),
        gpu=artifact_request("activations", "gpu"),
        nodes=artifact_request("activations", "nodes"),
    params:
        stage=stage_params("activations"),
    script:
        "../scripts/run_stage.py"


if "expert_inputs" in ART:

    rule collect_expert_inputs:
        input:
            model=artifact_path("model"),
            calibration=artifact_path("calibration"),
        output:
            expert_inputs=directory(artifact_path("expert_inputs")),
        log:
            stage_log("expert_inputs"),
        benchmark:
            stage_benchmark("expert_inputs")
        conda:
            conda_env("collect_expert_inputs")
        threads: CFG.numerics.threads
        resources:
            mem_mb=artifact_request("expert_inputs", "mem_mb"),
            disk_mb=artifact_request("expert_inputs", "disk_mb"),
            runtime=artifact_request("expert_inputs", "runtime"),
            gpu=artifact_request("expert_inputs", "gpu"),
            nodes=artifact_request("expert_inputs", "nodes"),
        params:
            stage=stage_params("expert_inputs"),
        script:
            "../scripts/run_stage.py"


rule quantize_layer:
    input:
        unpack(keyed_inputs),
    output:
        layers=directory(f"{CFG.results_dir}/quantize_layer/{{key}}"),
    log:
        f"{CFG.results_dir}/logs/quantize_layer/{{key}}.log",
    benchmark:
        f"{CFG.results_dir}/benchmarks/quantize_layer/{{key}}.tsv"
    wildcard_constraints:
        key="[0-9a-f]{64}",
    priority: SEARCH_PRIORITY
    conda:
        conda_env("quantize_layer")
    threads: 1
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
