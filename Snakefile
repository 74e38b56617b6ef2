# mixquant: BF16 MoE checkpoint -> audited, KL-gated mixed-precision ModelOpt checkpoint.
# Every output lives under results/<stage>/<key>/, keyed by the SHA-256 of what it depends on.
from snakemake.utils import min_version

min_version("9.0")


# The default config; a run given --configfile uses that file alone (Snakemake would merge it over this
# one, and say so), as mixquant.config.select_workflow_config reads it.
if not workflow.overwrite_configfiles:

    configfile: "config/config.yaml"


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"
include: "workflow/rules/model.smk"
include: "workflow/rules/calibration.smk"
include: "workflow/rules/prompt.smk"
include: "workflow/rules/eval.smk"
include: "workflow/rules/quantize.smk"
include: "workflow/rules/search.smk"
include: "workflow/rules/export.smk"
include: "workflow/rules/kld.smk"
include: "workflow/rules/verify.smk"
include: "workflow/rules/release.smk"


rule all:
    default_target: True
    input:
        all_targets,
        placed_targets,
