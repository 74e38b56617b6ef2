"""mixquant.quantize: quantizing a model to a per-layer mix of NVFP4 W4A16 / FP8 / BF16 routed experts."""
