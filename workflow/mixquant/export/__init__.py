"""mixquant.export: the audited ModelOpt-format mixed-precision checkpoint.

:mod:`~mixquant.export.checkpoint` assembles it from the source shards and the per-layer results
(:mod:`~mixquant.export.inputs` checks what it reads, :mod:`~mixquant.export.shard_plan` splits it into
shards, :mod:`~mixquant.export.modelopt_config` writes ModelOpt's configs); :mod:`~mixquant.export.predict`
derives tensor counts, payload bytes and effective routed-expert bits from config.json and a placement
alone; :mod:`~mixquant.export.inspect` audits an exported checkpoint directory from its safetensors
headers, index and JSON files, so the two can be compared number for number (:mod:`~mixquant.export.run`,
the stage, ships that comparison). :mod:`~mixquant.export.files` names the directory's files.
"""
