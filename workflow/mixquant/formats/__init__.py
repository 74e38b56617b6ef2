"""mixquant.formats: what the routed-expert formats are (:mod:`~mixquant.formats.facts`, torch-free) and
their numerics: ModelOpt's NVFP4 and FP8 on CPU, and fast NVFP4 scale fitting."""
