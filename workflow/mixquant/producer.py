"""Who made a checkpoint: recorded in its configs and part of the export's key (import-light on purpose:
key resolution runs on every Snakemake start and must not import torch or ModelOpt)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

import mixquant


def default_producer() -> dict[str, Any]:
    """``{"name": "mixquant", "version": ..., "numerics": {"name": "modelopt", "version": ...}}``.

    The installed ModelOpt version is the one whose numerics :mod:`mixquant.quantize.layer` reproduces
    (pinned to 0.47.* by the project).
    """
    try:
        modelopt_version = version("nvidia-modelopt")
    except PackageNotFoundError:  # pragma: no cover - modelopt is a hard dependency
        modelopt_version = "unknown"
    return {
        "name": "mixquant",
        "version": mixquant.__version__,
        "numerics": {"name": "modelopt", "version": modelopt_version},
    }
