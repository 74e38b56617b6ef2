# Calibration data: N samples x T tokens from the chat dataset through the chat template.


rule sample_calibration:
    input:
        model=artifact_path("model"),
    output:
        calibration=directory(artifact_path("calibration")),
    log:
        stage_log("calibration"),
    benchmark:
        stage_benchmark("calibration")
    conda:
        conda_env("sample_calibration")
    threads: 1
    resources:
        mem_mb=artifact_request("calibration", "mem_mb"),
        disk_mb=artifact_request("calibration", "disk_mb"),
        runtime=artifact_request("calibration", "runtime"),
        gpu=artifact_request("calibration", "gpu"),
        nodes=artifact_request("calibration", "nodes"),
    params:
        stage=stage_params("calibration"),
    script:
        "../scripts/run_stage.py"
