# The BF16 source model: the embedded toy Laguna is built and trained here (build_toy_model);
# a real model is pinned by hub revision or by the content of a local directory (fetch_model).


if CFG.model.source == "toy":

    rule build_toy_model:
        output:
            model=directory(artifact_path("model")),
        log:
            stage_log("model"),
        benchmark:
            stage_benchmark("model")
        conda:
            "../../envs/quant.yaml"
        threads: CFG.model.toy.threads
        resources:
            mem_mb=artifact_request("model", "mem_mb"),
            runtime=artifact_request("model", "runtime"),
        params:
            stage=stage_params("model"),
        script:
            "../scripts/build_toy_model.py"


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
        "../../envs/quant.yaml"
    threads: 1
    resources:
        mem_mb=keyed_mem_mb,
        runtime=keyed_runtime,
    params:
        stage=keyed_params,
    script:
        "../scripts/fetch_model.py"
