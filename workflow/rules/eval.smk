# The evaluation suite: W windows of T tokens over named domains, checked disjoint from the calibration data.


if CFG.kld.eval is not None:

    rule sample_eval:
        input:
            model=artifact_path("model"),
        output:
            eval=directory(artifact_path("eval")),
        log:
            stage_log("eval"),
        benchmark:
            stage_benchmark("eval")
        conda:
            conda_env("sample_eval")
        threads: 1
        resources:
            mem_mb=artifact_request("eval", "mem_mb"),
            disk_mb=artifact_request("eval", "disk_mb"),
            runtime=artifact_request("eval", "runtime"),
            gpu=artifact_request("eval", "gpu"),
            nodes=artifact_request("eval", "nodes"),
        params:
            stage=stage_params("eval"),
        script:
            "../scripts/run_stage.py"
