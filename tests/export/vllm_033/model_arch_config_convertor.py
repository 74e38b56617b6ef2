"""How vLLM reads a checkpoint's quantization config: ``ModelArchConfigConvertorBase``'s
``_normalize_quantization_config`` / ``get_quantization_config``
(vllm/transformers_utils/model_arch_config_convertor.py), which set ``quant_method`` for ModelOpt
configs (``modelopt_mixed`` for MIXED_PRECISION) before the quantization method is chosen.

Verbatim excerpts of vLLM 0.33.0 (PyPI wheel vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl,
sha256 4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa).
Each excerpt sits between ``# >>> vllm 0.33.0 <file>:<first>-<last>`` and ``# <<< ...`` markers
and is byte-identical to those lines of the wheel's file, except lines ending in
``# replaced import`` (an import of vLLM replaced by the local stand-in). Everything outside the
markers (this docstring, the imports, ``_stubs``) is not vLLM code. See README.md;
tests/export/test_vllm_resolution.py re-checks the excerpts against the wheel when it is available.
"""

from __future__ import annotations

from typing import Any

PreTrainedConfig = Any  # transformers.PreTrainedConfig (annotation only)


class ModelArchConfigConvertorBase:
    """Only the two methods below (model_arch_config_convertor.py:31); built with ``hf_config``."""

    def __init__(self, hf_config: Any) -> None:
        self.hf_config = hf_config

    # fmt: off
    # >>> vllm 0.33.0 vllm/transformers_utils/model_arch_config_convertor.py:241-292
    def _normalize_quantization_config(self, config: PreTrainedConfig):
        quant_cfg = getattr(config, "quantization_config", None)
        if quant_cfg is None:
            # compressed-tensors uses a "compression_config" key
            quant_cfg = getattr(config, "compression_config", None)

        else:
            # Set quant_method for ModelOpt models.
            producer_name = quant_cfg.get("producer", {}).get("name")
            modelopt_quant_cfg = quant_cfg.get("quantization", {})
            is_legacy_modelopt = (
                isinstance(modelopt_quant_cfg, dict)
                and "modelopt_quant_config" in modelopt_quant_cfg
            )
            if producer_name == "modelopt" or is_legacy_modelopt:
                quant_algo = modelopt_quant_cfg.get("quant_algo")
                if quant_algo is not None:
                    quant_algo_upper = str(quant_algo).upper()
                    if quant_algo_upper in {
                        "FP8",
                        "FP8_PER_CHANNEL_PER_TOKEN",
                        "FP8_PB_WO",
                    }:
                        quant_cfg["quant_method"] = "modelopt"
                    elif quant_algo_upper == "NVFP4":
                        quant_cfg["quant_method"] = "modelopt_fp4"
                    elif quant_algo_upper == "MIXED_PRECISION":
                        quant_cfg["quant_method"] = "modelopt_mixed"
                    else:
                        raise ValueError(f"Unknown ModelOpt quant algo: {quant_algo}")

        if quant_cfg is not None:
            # Use the community standard 'quant_method'
            quant_method = quant_cfg.get("quant_method", "").lower()

            # Normalize library names
            quant_method = quant_method.replace(
                "compressed_tensors", "compressed-tensors"
            )

            quant_cfg["quant_method"] = quant_method

        return quant_cfg

    def get_quantization_config(self):
        quant_cfg = self._normalize_quantization_config(self.hf_config)
        if quant_cfg is None and (
            text_config := getattr(self.hf_config, "text_config", None)
        ):
            # Check the text config as well for multi-modal models.
            quant_cfg = self._normalize_quantization_config(text_config)
        return quant_cfg
    # <<< vllm 0.33.0 vllm/transformers_utils/model_arch_config_convertor.py:241-292
    # fmt: on
