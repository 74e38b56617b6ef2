"""Typed workflow configuration: the single source of truth for config keys.

Every model forbids unknown fields, and every field has a description and a default where one
makes sense. ``workflow/schemas/config.schema.json`` is generated from these models
(``mixquant schema``; a test keeps it in sync) and Snakemake validates ``config`` against it, so
a misspelled or mistyped key is an error, never a silently ignored parameter. Errors are reported
as one line naming the key (``ConfigError``).

One module per group of sections: ``model`` (model, tokenizer), ``calibration`` (dataset, calibration,
prompt), ``placement``, ``quantize`` (quantize, export), ``kld``, ``release`` (published, expected,
release), ``runtime`` (numerics, software); ``root`` holds the whole config, ``loading`` reads and
validates it, ``schema`` generates its JSON schema and key table.
"""

from mixquant.config.base import ConfigError, Format, Sha256, Strict, parse_layer_ranges
from mixquant.config.loading import (
    load_config_file,
    read_config_file,
    select_workflow_config,
    validate_config,
    with_yaml_nulls,
)
from mixquant.config.release import PublishedHashes
from mixquant.config.root import MixquantConfig
from mixquant.config.schema import config_keys_markdown, json_schema

__all__ = [
    "ConfigError",
    "Format",
    "MixquantConfig",
    "PublishedHashes",
    "Sha256",
    "Strict",
    "config_keys_markdown",
    "json_schema",
    "load_config_file",
    "parse_layer_ranges",
    "read_config_file",
    "select_workflow_config",
    "validate_config",
    "with_yaml_nulls",
]
