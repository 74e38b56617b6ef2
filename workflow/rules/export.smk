# The checkpoint users download: source tensors copied byte for byte, quantized layers from
# quantize_layer, ModelOpt's hf_quant_config.json / quantization_config, shards, index and audit.


rule export_checkpoint:
    input:
        unpack(keyed_inputs),
    output:
        checkpoint=directory(f"{CFG.results_dir}/export_checkpoint/{{key}}"),
    log:
        f"{CFG.results_dir}/logs/export_checkpoint/{{key}}.log",
    benchmark:
        f"{CFG.results_dir}/benchmarks/export_checkpoint/{{key}}.tsv"
    wildcard_constraints:
        key="[0-9a-f]{64}",
    conda:
        conda_env("export_checkpoint")
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
