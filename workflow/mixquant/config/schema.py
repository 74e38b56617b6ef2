"""The config's JSON schema (workflow/schemas/config.schema.json) and key table (config/README.md), generated
from the typed config."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from mixquant.config.root import MixquantConfig


def json_schema() -> dict[str, Any]:
    """JSON schema of the config (draft 2020-12) with additionalProperties: false on every object."""
    schema = MixquantConfig.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "mixquant workflow configuration"
    return schema


def _submodels(annotation: Any) -> list[type[BaseModel]]:
    found = []
    for candidate in (annotation, *getattr(annotation, "__args__", ())):
        for inner in (candidate, *getattr(candidate, "__args__", ())):
            if isinstance(inner, type) and issubclass(inner, BaseModel) and inner not in found:
                found.append(inner)
    return found


def config_keys_markdown(model: type[BaseModel] = MixquantConfig, prefix: str = "") -> list[str]:
    """Table rows `| key | default | description |` for every key, depth first (config/README.md)."""
    rows = []
    for name, field in model.model_fields.items():
        key = prefix + name
        nested = _submodels(field.annotation)
        if field.is_required():
            default = "required"
        elif nested and field.default_factory is not None:
            default = "(section)"
        else:
            value = field.get_default(call_default_factory=True)
            default = f"`{value!r}`" if not isinstance(value, BaseModel) else "(section)"
        rows.append(f"| `{key}` | {default} | {field.description or ''} |")
        for sub in nested:
            rows.extend(config_keys_markdown(sub, key + "."))
    return rows
