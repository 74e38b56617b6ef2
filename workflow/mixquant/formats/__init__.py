"""mixquant.formats: CPU support for ModelOpt's NVFP4 numerics and fast NVFP4 scale fitting."""
