# The release bundle: the checkpoint, quantization_recipe.yaml (replays the build), the placement and
# checkpoint audits, the KLD aggregates and the model card -- assembled only after the KLD gates pass.


rule assemble_release:
    input:
        unpack(keyed_inputs),
    output:
        release=directory(f"{CFG.results_dir}/assemble_release/{{key}}"),
    log:
        f"{CFG.results_dir}/logs/assemble_release/{{key}}.log",
    benchmark:
        f"{CFG.results_dir}/benchmarks/assemble_release/{{key}}.tsv"
    wildcard_constraints:
        key="[0-9a-f]{64}",
    conda:
        conda_env("assemble_release")
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
