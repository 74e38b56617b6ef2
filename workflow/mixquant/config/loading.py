"""Reading and validating a config: a file's mapping, the config Snakemake hands the Snakefile, and one line
that names the key for every problem."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from mixquant.config.base import ConfigError
from mixquant.config.root import MixquantConfig


def _known_fields(model: type[BaseModel], loc: tuple) -> list[str]:
    """Field names allowed at `loc` (for 'did you mean' hints); empty if it cannot be resolved."""
    current: Any = model
    for part in loc:
        if isinstance(part, int) or current is None:
            continue
        field = getattr(current, "model_fields", {}).get(part)
        if field is None:
            return []
        annotation = field.annotation
        current = None
        for candidate in (annotation, *getattr(annotation, "__args__", ())):
            for inner in (candidate, *getattr(candidate, "__args__", ())):
                if isinstance(inner, type) and issubclass(inner, BaseModel):
                    current = inner
    return list(getattr(current, "model_fields", {}))


def _one_line(error: ValidationError, source: str) -> str:
    first = error.errors()[0]
    loc = tuple(first["loc"])
    key = ".".join(str(part) for part in loc) or "(root)"
    if first["type"] == "extra_forbidden":
        allowed = _known_fields(MixquantConfig, loc[:-1])
        hint = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        suggestion = f"; did you mean '{'.'.join(str(p) for p in loc[:-1] + (hint[0],))}'?" if hint else ""
        return f"{source}: unknown config key '{key}'{suggestion}"
    if first["type"] == "missing":
        return f"{source}: missing config key '{key}'"
    if "input" in first and first["input"] is None and loc:
        return f"{source}: config key '{key}' cannot be null: give it a value"
    message = first["msg"].replace("Value error, ", "")
    got = first.get("input")
    shown = "" if isinstance(got, (dict, list)) else f" (got {got!r})"
    more = len(error.errors()) - 1
    return f"{source}: config key '{key}': {message}{shown}" + (f" [+{more} more]" if more else "")


# YAML's null spellings. Snakemake reads a --config value as YAML with every scalar a string (its
# BaseLoader: 'published={quant_config: null}' gives the string 'null'), so a string spelled so means null.
YAML_NULLS = frozenset({"null", "Null", "NULL", "~"})


def with_yaml_nulls(value: Any) -> Any:
    """`value` with every string spelled as YAML null (:data:`YAML_NULLS`) replaced by None, recursively."""
    if isinstance(value, dict):
        return {key: with_yaml_nulls(item) for key, item in value.items()}
    if isinstance(value, list):
        return [with_yaml_nulls(item) for item in value]
    return None if isinstance(value, str) and value in YAML_NULLS else value


def validate_config(raw: dict[str, Any], source: str = "config") -> MixquantConfig:
    """Validate a raw config mapping; raise ConfigError with one line naming the offending key.

    ``null`` or ``~`` (also as a ``--config`` string) unsets a nullable key; a key that cannot be null
    set so is one line naming it.
    """
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the config must be a mapping, got {type(raw).__name__}")
    try:
        return MixquantConfig.model_validate(with_yaml_nulls(raw))
    except ValidationError as error:
        raise ConfigError(_one_line(error, source)) from None


def load_config_file(path: str | Path) -> MixquantConfig:
    return validate_config(read_config_file(path), str(path))


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A config file's mapping as written (not validated); a missing file or bad YAML is one line."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ConfigError(f"{path}: not valid YAML: {problem}{where}") from None
    return raw or {}


def select_workflow_config(
    merged: dict[str, Any], cli_configfiles: list[str] | None, cli_config: dict[str, Any] | None
) -> dict[str, Any]:
    """The config the user meant, from what Snakemake hands the Snakefile.

    Snakemake *merges* ``--configfile`` files over the Snakefile's default ``configfile:``, which
    would mix the toy default's sections into the real model's config. When config files are given
    on the command line they replace the default; ``--config`` overrides still apply.
    """
    if cli_configfiles:
        return dict(cli_config or {})
    return merged
