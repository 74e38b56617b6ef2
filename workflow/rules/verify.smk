# The release's four SHA-256 values (prompt token IDs, reference logits, hf_quant_config.json, the
# safetensors index) re-derived and compared with config `published`: a content mismatch fails the workflow,
# a numerical one only under an equal numerics fingerprint; an artifact made otherwise is "not comparable".


rule verify_hashes:
    input:
        unpack(keyed_inputs),
    output:
        verify=directory(f"{CFG.results_dir}/verify_hashes/{{key}}"),
    log:
        f"{CFG.results_dir}/logs/verify_hashes/{{key}}.log",
    benchmark:
        f"{CFG.results_dir}/benchmarks/verify_hashes/{{key}}.tsv"
    wildcard_constraints:
        key="[0-9a-f]{64}",
    conda:
        conda_env("verify_hashes")
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
