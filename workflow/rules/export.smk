# The checkpoint users download: source tensors copied byte for byte, quantized layers from
# quantize_layer, ModelOpt's hf_quant_config.json / quantization_config, shards, index and audit.


rule export_checkpoint:
    input:
        unpack(export_inputs),
    output:
        checkpoint=directory(artifact_path("checkpoint")),
    log:
        stage_log("checkpoint"),
    benchmark:
        stage_benchmark("checkpoint")
    conda:
        "../../envs/quant.yaml"
    threads: 1
    resources:
        mem_mb=4000,
        runtime=120,
    params:
        stage=stage_params("checkpoint"),
    script:
        "../scripts/export_checkpoint.py"
