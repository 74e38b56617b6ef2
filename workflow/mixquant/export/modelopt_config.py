"""The configs of a ModelOpt checkpoint, computed by ModelOpt's own code: ``hf_quant_config.json`` and
config.json's ``quantization_config`` for a placement, and config.json sanitised for deployment.

Both files only exist when something is quantized (experts or KV cache): ``MIXED_PRECISION`` with
``quantized_layers`` when the quantized MoE layers use more than one format, the single-algorithm form
(``quant_algo``, ``group_size``, ``exclude_modules`` summarised with prefix wildcards) otherwise; BF16
layers are absent; ``kv_cache_quant_algo`` / ``kv_cache_scheme`` as configured. Written with
``json.dump(indent=4)`` and no trailing newline, as ModelOpt writes them.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mixquant.formats.facts import FP8
from mixquant.quantize.reference import modelopt_placement_quant_cfg

__all__ = [
    "dump_modelopt_json",
    "modelopt_hf_quant_config",
    "modelopt_quantization_config",
    "sanitized_config",
]


@contextlib.contextmanager
def _quiet() -> Any:
    with (
        contextlib.redirect_stdout(io.StringIO()),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")
        yield


def _placement_quant_cfg(placement: Mapping[int, str], kv_cache: str | None) -> dict[str, Any]:
    import modelopt.torch.quantization as mtq

    # The calibration algorithm changes no quantizer's format, hence nothing in the config.
    quant_cfg, _ = modelopt_placement_quant_cfg(
        dict(placement), nvfp4_algorithm="max", fp8_weight_algorithm="max"
    )
    if kv_cache == FP8:
        quant_cfg["quant_cfg"].extend(copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"]))
    return quant_cfg


def modelopt_hf_quant_config(
    config: Mapping[str, Any],
    placement: Mapping[int, str],
    *,
    kv_cache: str | None = None,
    producer: Mapping[str, Any] | None = None,
) -> dict[str, Any] | None:
    """The ``hf_quant_config.json`` content ModelOpt 0.47 exports for ``placement``; None if unquantized.

    Computed by ModelOpt itself, without weights: the model's class is built on the meta device from
    ``config`` (the source config.json dict), ModelOpt's quantize mode is applied with the placement's
    ``quant_cfg`` (:func:`mixquant.quantize.reference.modelopt_placement_quant_cfg`, plus
    ``mtq.FP8_KV_CFG`` for ``kv_cache="fp8"``) -- the same module conversion ``mtq.quantize`` does,
    without calibration, which decides no format -- then ``get_quant_config`` and the quant-aware
    reverse renaming of module names (``build_reverse_name_mapper`` + ``revert_quant_config_names``),
    as ``export_hf_checkpoint`` does. ``None`` when ModelOpt would write no hf_quant_config.json (no
    quantized layer and no KV-cache quantization). ``producer`` replaces ModelOpt's if given.
    """
    import modelopt.torch.opt as mto
    from modelopt.torch.export.quant_aware_conversion import (
        build_reverse_name_mapper,
        revert_quant_config_names,
    )
    from modelopt.torch.export.quant_utils import get_quant_config
    from transformers import AutoConfig, AutoModelForCausalLM

    config = {k: v for k, v in config.items() if k != "quantization_config"}
    with _quiet():
        hf_config = AutoConfig.for_model(**config)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
        model = mto.apply_mode(model, mode=[("quantize", _placement_quant_cfg(placement, kv_cache))])
        quant_config = get_quant_config(model)
        mapper = build_reverse_name_mapper(model)
        if mapper is not None:
            revert_quant_config_names(quant_config.get("quantization", {}), mapper)
    quantization = quant_config.get("quantization", {})
    if quantization.get("quant_algo") is None and quantization.get("kv_cache_quant_algo") is None:
        return None
    if producer is not None:
        quant_config["producer"] = copy.deepcopy(dict(producer))
    return quant_config


def modelopt_quantization_config(hf_quant_config: Mapping[str, Any]) -> dict[str, Any]:
    """config.json's ``quantization_config``: ModelOpt's ``convert_hf_quant_config_format``."""
    from modelopt.torch.export.convert_hf_config import convert_hf_quant_config_format

    return convert_hf_quant_config_format(copy.deepcopy(dict(hf_quant_config)))


def sanitized_config(config: dict[str, Any]) -> dict[str, Any]:
    """ModelOpt's ``sanitize_hf_config_for_deployment`` (no in-memory model: config keys only)."""
    from modelopt.torch.export.plugins import sanitize_hf_config_for_deployment

    config = copy.deepcopy(config)
    with _quiet():
        sanitize_hf_config_for_deployment(config, None)
    return config


def dump_modelopt_json(path: Path, data: Any) -> None:
    """``json.dump(data, f, indent=4)``: ModelOpt's formatting (no trailing newline)."""
    path.write_text(json.dumps(data, indent=4), encoding="utf-8")
