"""Cluster cost model: per-job resources of each workflow stage, from the model geometry alone.

Every estimate follows what the stage's code does today (which files it reads and writes, what it holds
in memory, on which device it computes); docs/cost-model.md documents the formulas. Runtime is
the no-overlap sum ``startup + bytes_read / read_bw + bytes_written / write_bw + download + compute``
(an upper bound: the stages load, then compute, then publish). Every keyed output is re-read and hashed
for its manifest (``publish_keyed_dir``), so a stage's output bytes are also read and hashed once.

:mod:`~mixquant.costs.hardware` holds the assumptions, :mod:`~mixquant.costs.job` one job's shared part
and the dispatch to the stage's cost function (named by the stage registry: ``sources``, ``rebuild``,
``kld``, ``release``), :mod:`~mixquant.costs.resources` the cluster request, :mod:`~mixquant.costs.table`
the table on docs/cost-model.md. The model geometry is :mod:`mixquant.facts`'.
"""

from mixquant.costs.hardware import B200, Hardware
from mixquant.costs.job import StageCost, stage_cost
from mixquant.costs.resources import disk_mb, job_gpus, rule_resources
from mixquant.costs.sizes import placement_counts, score_macro_batch
from mixquant.costs.table import cost_table_markdown

__all__ = [
    "B200",
    "Hardware",
    "StageCost",
    "cost_table_markdown",
    "disk_mb",
    "job_gpus",
    "placement_counts",
    "rule_resources",
    "score_macro_batch",
    "stage_cost",
]
