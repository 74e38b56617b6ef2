"""Verbatim vLLM 0.33.0 excerpts and recording stand-ins for ../vllm_resolution.py; see README.md."""
