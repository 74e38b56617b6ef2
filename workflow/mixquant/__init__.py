"""mixquant: reproducible mixed-precision quantization of MoE LLMs (library; never imports snakemake)."""

__version__ = "0.1.0"
