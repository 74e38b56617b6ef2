# The BF16 source model: the embedded toy Laguna is built and trained here (build_toy_model);
# a real model is pinned by hub revision or by the content of a local directory (fetch_model), and a
# block-FP8 one made BF16 by its publisher's dequantization (dequantize_source).


if CFG.model.source == "toy":

    rule build_toy_model:
        output:
            model=directory(artifact_path("model")),
        log:
            stage_log("model"),
        benchmark:
            stage_benchmark("model")
        conda:
            conda_env("build_toy_model")
        threads: CFG.model.toy.threads
        resources:
            mem_mb=artifact_request("model", "mem_mb"),
            disk_mb=artifact_request("model", "disk_mb"),
            runtime=artifact_request("model", "runtime"),
            gpu=artifact_request("model", "gpu"),
            nodes=artifact_request("model", "nodes"),
        params:
            stage=stage_params("model"),
        script:
            "../scripts/run_stage.py"


# Real models and external KLD candidates: pinned by hub revision or by local content.
rule fetch_model:
    output:
        model=directory(f"{CFG.results_dir}/fetch_model/{{key}}"),
    log:
        f"{CFG.results_dir}/logs/fetch_model/{{key}}.log",
    benchmark:
        f"{CFG.results_dir}/benchmarks/fetch_model/{{key}}.tsv"
    wildcard_constraints:
        key="[0-9a-f]{64}",
    conda:
        conda_env("fetch_model")
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


# A source published in block FP8 (DeepSeek-V3, MiniMax-M2) becomes the BF16 source every stage reads.
rule dequantize_source:
    input:
        unpack(keyed_inputs),
    output:
        model=directory(f"{CFG.results_dir}/dequantize_source/{{key}}"),
    log:
        f"{CFG.results_dir}/logs/dequantize_source/{{key}}.log",
    benchmark:
        f"{CFG.results_dir}/benchmarks/dequantize_source/{{key}}.tsv"
    wildcard_constraints:
        key="[0-9a-f]{64}",
    conda:
        conda_env("dequantize_source")
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
