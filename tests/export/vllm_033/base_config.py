"""The parts of ``QuantizationConfig`` (vllm/model_executor/layers/quantization/base_config.py) that
the ModelOpt mixed-precision config uses to parse and resolve layer names (abstract methods,
weight-loading hooks and the rest omitted).

Verbatim excerpts of vLLM 0.33.0 (PyPI wheel vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl,
sha256 4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa).
Each excerpt sits between ``# >>> vllm 0.33.0 <file>:<first>-<last>`` and ``# <<< ...`` markers
and is byte-identical to those lines of the wheel's file, except lines ending in
``# replaced import`` (an import of vLLM replaced by the local stand-in). Everything outside the
markers (this docstring, the imports, ``_stubs``) is not vLLM code. See README.md;
tests/export/test_vllm_resolution.py re-checks the excerpts against the wheel when it is available.
"""

# ruff: noqa: UP037, B024
from __future__ import annotations

from abc import ABC
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._stubs import OnlineQuantizationConfig
    from .models_utils import WeightsMapper


# fmt: off
# >>> vllm 0.33.0 vllm/model_executor/layers/quantization/base_config.py:109-129
class QuantizationConfig(ABC):
    """Base class for quantization configs."""

    _ignore_unexpected_suffixes = (
        ".q_scale",
        ".k_scale",
        ".v_scale",
        ".q_zero_point",
        ".k_zero_point",
        ".v_zero_point",
    )
    """Suffixes of quantization parameters that may be present in the checkpoint but
    not in the model, and should be ignored if unexpected during loading. These are used
    after remapping, so should be in vLLM format (e.g. .q_scale, not .q.scale)."""
    online_quantization_config: "OnlineQuantizationConfig | None" = None

    def __init__(self):
        super().__init__()
        # mapping is updated by models as they initialize
        self.packed_modules_mapping: dict[str, list[str]] = dict()

# <<< vllm 0.33.0 vllm/model_executor/layers/quantization/base_config.py:109-129
# fmt: on


    # [omitted: base_config.py:130-183 (abstract interface)]


# fmt: off
# >>> vllm 0.33.0 vllm/model_executor/layers/quantization/base_config.py:184-193
    @staticmethod
    def get_from_keys(config: dict[str, Any], keys: list[str]) -> Any:
        """Get a value from the model's quantization config."""
        for key in keys:
            if key in config:
                return config[key]
        raise ValueError(
            f"Cannot find any of {keys} in the model's quantization config."
        )

# <<< vllm 0.33.0 vllm/model_executor/layers/quantization/base_config.py:184-193
# fmt: on


    # [omitted: base_config.py:194-260]


# fmt: off
# >>> vllm 0.33.0 vllm/model_executor/layers/quantization/base_config.py:261-273
    def apply_vllm_mapper(  # noqa: B027
        self, hf_to_vllm_mapper: "WeightsMapper"
    ):
        """Interface for models to update module names referenced in
        quantization configs in order to reflect the vllm model structure

        Args:
            hf_to_vllm_mapper: maps from hf model structure (the assumed
                structure of the qconfig) to vllm model structure

        """
        # TODO (@kylesayrs): add implementations for all subclasses
        pass
# <<< vllm 0.33.0 vllm/model_executor/layers/quantization/base_config.py:261-273
# fmt: on
