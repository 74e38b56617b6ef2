# Calibration data: N samples x T tokens from the chat dataset through the chat template (and, for the
# placement refinement, the held-out sequences that continue the same draw).


rule sample_calibration:
    input:
        unpack(keyed_inputs),
    output:
        calibration=directory(f"{CFG.results_dir}/sample_calibration/{{key}}"),
    log:
        f"{CFG.results_dir}/logs/sample_calibration/{{key}}.log",
    benchmark:
        f"{CFG.results_dir}/benchmarks/sample_calibration/{{key}}.tsv"
    wildcard_constraints:
        key="[0-9a-f]{64}",
    priority: SEARCH_PRIORITY
    conda:
        conda_env("sample_calibration")
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
