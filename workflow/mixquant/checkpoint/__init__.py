"""Safetensors I/O every stage shares: validated headers and a counting, streaming tensor reader."""
