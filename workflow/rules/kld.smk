# KLD gates: BF16 reference logits on the pinned prompt; per (candidate, KV dtype) one run_kld job doing
# every run with a fresh engine (hf: a new engine object; vllm: a new process per run) and a gate; the
# comparison report and the verdict.


rule reference_logits:
    input:
        unpack(keyed_inputs),
    output:
        reference=directory(f"{CFG.results_dir}/reference_logits/{{key}}"),
    log:
        f"{CFG.results_dir}/logs/reference_logits/{{key}}.log",
    benchmark:
        f"{CFG.results_dir}/benchmarks/reference_logits/{{key}}.tsv"
    wildcard_constraints:
        key="[0-9a-f]{64}",
    conda:
        conda_env("reference_logits")
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


rule run_kld:
    input:
        unpack(keyed_inputs),
    output:
        runs=directory(f"{CFG.results_dir}/run_kld/{{key}}"),
    log:
        f"{CFG.results_dir}/logs/run_kld/{{key}}.log",
    benchmark:
        f"{CFG.results_dir}/benchmarks/run_kld/{{key}}.tsv"
    wildcard_constraints:
        key="[0-9a-f]{64}",
    conda:
        conda_env("run_kld")
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


rule gate_kld:
    input:
        unpack(keyed_inputs),
    output:
        gate=directory(f"{CFG.results_dir}/gate_kld/{{key}}"),
    log:
        f"{CFG.results_dir}/logs/gate_kld/{{key}}.log",
    wildcard_constraints:
        key="[0-9a-f]{64}",
    conda:
        conda_env("gate_kld")
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


rule kld_report:
    input:
        unpack(keyed_inputs),
    output:
        report=report(
            directory(f"{CFG.results_dir}/kld_report/{{key}}"),
            patterns=["{plot}.png", "{table}.csv"],
            caption="../report/kld.rst",
            category="KL divergence",
        ),
    log:
        f"{CFG.results_dir}/logs/kld_report/{{key}}.log",
    wildcard_constraints:
        key="[0-9a-f]{64}",
    conda:
        conda_env("kld_report")
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


rule check_kld_gates:
    input:
        unpack(keyed_inputs),
    output:
        verdict=directory(f"{CFG.results_dir}/check_kld_gates/{{key}}"),
    log:
        f"{CFG.results_dir}/logs/check_kld_gates/{{key}}.log",
    wildcard_constraints:
        key="[0-9a-f]{64}",
    conda:
        conda_env("check_kld_gates")
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
