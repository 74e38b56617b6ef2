"""Safetensors I/O every stage shares: validated headers (:mod:`~mixquant.checkpoint.headers`, torch-free),
a counting, streaming tensor reader (:mod:`~mixquant.checkpoint.shards`), the deterministic writer
(:mod:`~mixquant.checkpoint.writer`), the one write-then-rename (:mod:`~mixquant.checkpoint.atomic`) and
the block-FP8 source (:mod:`~mixquant.checkpoint.fp8_config`, :mod:`~mixquant.checkpoint.fp8_source`)."""
