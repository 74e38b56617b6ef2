"""KL-divergence gate: per-position statistics vs the BF16 reference, run aggregation, gates and reports."""
