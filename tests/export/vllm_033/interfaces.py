"""``SupportsQuant`` from vllm/model_executor/models/interfaces.py (applies the model's mapper).

Verbatim excerpts of vLLM 0.33.0 (PyPI wheel vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl,
sha256 4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa).
Each excerpt sits between ``# >>> vllm 0.33.0 <file>:<first>-<last>`` and ``# <<< ...`` markers
and is byte-identical to those lines of the wheel's file, except lines ending in
``# replaced import`` (an import of vLLM replaced by the local stand-in). Everything outside the
markers (this docstring, the imports, ``_stubs``) is not vLLM code. See README.md;
tests/export/test_vllm_resolution.py re-checks the excerpts against the wheel when it is available.
"""

# ruff: noqa: UP037
from __future__ import annotations

from typing import TYPE_CHECKING, Self

from .base_config import QuantizationConfig

if TYPE_CHECKING:
    from .models_utils import WeightsMapper


# fmt: off
# >>> vllm 0.33.0 vllm/model_executor/models/interfaces.py:1260-1299
class SupportsQuant:
    """The interface required for all models that support quantization."""

    hf_to_vllm_mapper: "WeightsMapper | None" = None
    packed_modules_mapping: dict[str, list[str]]
    quant_config: QuantizationConfig | None = None

    def __new__(cls, *args, **kwargs) -> Self:
        instance = super().__new__(cls)

        # find config passed in arguments and attach it to model for general use
        instance.quant_config = cls._find_quant_config(*args, **kwargs)

        cls._maybe_apply_model_mapping(instance)

        return instance

    @staticmethod
    def _find_quant_config(*args, **kwargs) -> QuantizationConfig | None:
        """Find quant config passed through model constructor args"""
        from ._stubs import VllmConfig  # replaced import

        args_values = list(args) + list(kwargs.values())
        for arg in args_values:
            if isinstance(arg, VllmConfig):
                return arg.quant_config

            if isinstance(arg, QuantizationConfig):
                return arg

        return None

    def _maybe_apply_model_mapping(self):
        """Apply model mappings to config for proper config-model matching"""
        if self.quant_config is None:
            return
        if (hf_to_vllm_mapper := self.hf_to_vllm_mapper) is not None:
            self.quant_config.apply_vllm_mapper(hf_to_vllm_mapper.get_rename_mapper())
        if packed_modules_mapping := getattr(self, "packed_modules_mapping", None):
            self.quant_config.packed_modules_mapping.update(packed_modules_mapping)
# <<< vllm 0.33.0 vllm/model_executor/models/interfaces.py:1260-1299
# fmt: on
