"""``configure_quant_config`` from vllm/model_executor/model_loader/utils.py (called by
``initialize_model``, utils.py:93-94, before the model class is instantiated).

Verbatim excerpts of vLLM 0.33.0 (PyPI wheel vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl,
sha256 4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa).
Each excerpt sits between ``# >>> vllm 0.33.0 <file>:<first>-<last>`` and ``# <<< ...`` markers
and is byte-identical to those lines of the wheel's file, except lines ending in
``# replaced import`` (an import of vLLM replaced by the local stand-in). Everything outside the
markers (this docstring, the imports, ``_stubs``) is not vLLM code. See README.md;
tests/export/test_vllm_resolution.py re-checks the excerpts against the wheel when it is available.
"""

from __future__ import annotations

from ._stubs import nn
from .base_config import QuantizationConfig
from .interfaces import SupportsQuant


# fmt: off
# >>> vllm 0.33.0 vllm/model_executor/model_loader/utils.py:367-387
def configure_quant_config(
    quant_config: QuantizationConfig, model_class: type[nn.Module]
):
    """Pass packed_modules_mapping by reference to quant_config so that
    quant_config can properly match fused modules

    Note that model attributes are passed by reference to quant_config,
    enabling them to be updated by model_class.__new__ (ex. chatglm, qwen)

    Once the `SupportsQuant` mixin has been added to all models, this
    function can be removed
    """
    if not issubclass(model_class, SupportsQuant):
        hf_to_vllm_mapper = getattr(model_class, "hf_to_vllm_mapper", None)
        packed_mapping = getattr(model_class, "packed_modules_mapping", None)

        # pass mappings by reference to quant_config
        if hf_to_vllm_mapper is not None:
            quant_config.apply_vllm_mapper(hf_to_vllm_mapper.get_rename_mapper())
        if packed_mapping is not None:
            quant_config.packed_modules_mapping = packed_mapping
# <<< vllm 0.33.0 vllm/model_executor/model_loader/utils.py:367-387
# fmt: on
