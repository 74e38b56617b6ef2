"""Verbatim vLLM 0.34.0 excerpts and recording stand-ins for ../vllm_resolution.py; see README.md."""
