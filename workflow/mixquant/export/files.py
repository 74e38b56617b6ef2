"""The files of an exported checkpoint directory, by name (torch-free: the audit, the release and the
planning read them)."""

from __future__ import annotations

from mixquant.checkpoint.headers import CONFIG_FILE, GENERATION_CONFIG_FILE, INDEX_FILE

__all__ = [
    "AUDIT_FILE",
    "CONFIG_FILE",
    "CONFIG_FILES",
    "GENERATION_CONFIG_FILE",
    "INDEX_FILE",
    "QUANT_CONFIG_FILE",
    "TOKENIZER_FILES",
]

QUANT_CONFIG_FILE = "hf_quant_config.json"  # ModelOpt's quantization config
CONFIG_FILES = frozenset({CONFIG_FILE, GENERATION_CONFIG_FILE, QUANT_CONFIG_FILE})
# What the export audit (the checkpoint against the prediction) is shipped as.
AUDIT_FILE = "checkpoint_audit.json"
# Tokenizer files copied into the export when present (tokenizer.json or tokenizer.model must be among them).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
)
