# The KLD prompt: T token IDs whose SHA-256 is checked against the configured pin.


rule pin_prompt:
    input:
        model=artifact_path("model"),
    output:
        prompt=directory(artifact_path("prompt")),
    log:
        stage_log("prompt"),
    benchmark:
        stage_benchmark("prompt")
    conda:
        conda_env("pin_prompt")
    threads: 1
    resources:
        mem_mb=artifact_request("prompt", "mem_mb"),
        disk_mb=artifact_request("prompt", "disk_mb"),
        runtime=artifact_request("prompt", "runtime"),
        gpu=artifact_request("prompt", "gpu"),
        nodes=artifact_request("prompt", "nodes"),
    params:
        stage=stage_params("prompt"),
    script:
        "../scripts/run_stage.py"
