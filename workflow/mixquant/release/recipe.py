"""The release's ``quantization_recipe.yaml``: the resolved config with the chosen placement written down.

Running the workflow from the recipe alone (``snakemake --configfile quantization_recipe.yaml``) rebuilds
the same checkpoint: every setting is resolved (defaults filled in), and the placement the search chose
becomes ``placement.source: explicit`` with its layer map. Keys do not depend on how the placement was
found -- the export's key holds the placement by content (``mixquant.graph.rebuild.add_export``) --
so the recipe reproduces the keys of the model, calibration, activation statistics, every placed layer x
format result, the checkpoint and the KLD runs on it. ``results_dir`` (a path, not a setting) is left out:
the replay writes under the default ``results/``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from mixquant.config import MixquantConfig, load_config_file, validate_config
from mixquant.formats.facts import BF16
from mixquant.formats.facts import FORMATS as FORMAT_ORDER

RECIPE_FILE = "quantization_recipe.yaml"


def layer_ranges(layers: list[int]) -> str:
    """[1, 2, 3, 5, 7, 8] -> '1-3,5,7-8' (the config's layer-range syntax)."""
    parts: list[str] = []
    ordered = sorted(layers)
    start = previous = ordered[0]
    for layer in ordered[1:] + [None]:
        if layer is not None and layer == previous + 1:
            previous = layer
            continue
        parts.append(str(start) if start == previous else f"{start}-{previous}")
        if layer is not None:
            start = previous = layer
    return ",".join(parts)


def explicit_placement(placement: Mapping[int, str]) -> dict[str, Any]:
    """``placement.explicit`` naming every MoE layer's format (BF16 ranges listed too, for the reader)."""
    if not placement:
        raise ValueError("the placement names no MoE layer")
    entries = []
    for fmt in FORMAT_ORDER:
        layers = [layer for layer, chosen in placement.items() if chosen == fmt]
        if layers:
            entries.append({"layers": layer_ranges(layers), "format": fmt})
    unknown = sorted({fmt for fmt in placement.values() if fmt not in FORMAT_ORDER})
    if unknown:
        raise ValueError(f"placement names unknown format {unknown[0]!r}")
    return {"default_format": BF16, "layers": entries}


def recipe_document(cfg: MixquantConfig, placement: Mapping[int, str]) -> dict[str, Any]:
    """The resolved config as plain data, with ``placement.source: explicit`` and the chosen map.

    The search settings stay (provenance: how the placement was found); with ``source: explicit`` they
    are not used. The result is validated with the project's config model before it is returned.
    """
    document = cfg.model_dump(mode="json")
    document.pop("results_dir")
    document["placement"]["source"] = "explicit"
    document["placement"]["explicit"] = explicit_placement(placement)
    validate_config(document, "quantization recipe")
    return document


def recipe_yaml(document: Mapping[str, Any], header: list[str]) -> str:
    """YAML text of the recipe, opened by ``# ``-comment header lines."""
    comments = "".join(f"# {line}\n" if line else "#\n" for line in header)
    return comments + yaml.safe_dump(dict(document), sort_keys=False, allow_unicode=True, width=100)


def load_recipe(path: str | Path) -> MixquantConfig:
    """A recipe through the project's config loader (the same validation the Snakefile applies)."""
    return load_config_file(path)
