"""Stand-ins for the vLLM / torch objects the vendored excerpts import -- NOT vLLM code.

The excerpts only test layer and config *types* (``isinstance`` / ``issubclass``) and construct
quantize-method and sub-config objects; the stand-ins below are empty classes, and the
constructed objects merely record their arguments, so that a resolution can be read back
(``type(method).__name__``, ``method.kwargs``) without torch, CUDA or compiled kernels.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

# vllm.model_executor.models.utils: ShardId / ShardIds type aliases (utils.py:42-45).
ShardIds = Any

# vllm.model_executor.layers.quantization.QuantizationMethods is a Literal of method names.
QuantizationMethods = str


class _Logger:
    """vllm.logger's logger: ``warning_once`` / ``info_once`` on top of logging."""

    def __init__(self, name: str) -> None:
        self._log = logging.getLogger(name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._log, name.removesuffix("_once"))


def init_logger(name: str) -> _Logger:
    return _Logger(name)


class _Recorded:
    """An object built by the excerpts: remembers its constructor arguments."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.kwargs = kwargs
        for key, value in kwargs.items():
            setattr(self, key, value)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(**{self.kwargs!r})"


# -- quantize methods (what get_quant_method returns)
class QuantizeMethodBase(_Recorded):
    pass


class FusedMoEMethodBase(QuantizeMethodBase):
    pass


class BaseKVCacheMethod(QuantizeMethodBase):
    pass


class ModelOptKVCacheMethod(BaseKVCacheMethod):
    pass


class UnquantizedLinearMethod(QuantizeMethodBase):
    pass


class ModelOptLinearMethod(QuantizeMethodBase):
    pass


class Fp8MoEMethod(FusedMoEMethodBase):
    pass


class ModelOptFp8MoEMethod(FusedMoEMethodBase):
    pass


class ModelOptNvFp4FusedMoE(FusedMoEMethodBase):
    pass


class ModelOptMxFp8FusedMoE(FusedMoEMethodBase):
    pass


def build_linear_method(config: Any, algo: str, prefix: str) -> ModelOptLinearMethod:
    return ModelOptLinearMethod(config=config, algo=algo, prefix=prefix)


# -- sub-configs built by ModelOptMixedPrecisionConfig._from_config / __init__
class ModelOptFp8Config(_Recorded):
    pass


class ModelOptNvFp4Config(_Recorded):
    pass


class ModelOptMxFp8Config(_Recorded):
    pass


class Fp8Config(_Recorded):
    pass


# -- layer types get_quant_method dispatches on
class Attention:
    pass


class MLAAttention:
    pass


class LinearBase:
    pass


class VocabParallelEmbedding:
    pass


class ParallelLMHead(VocabParallelEmbedding):
    pass


class RoutedExperts:
    """vllm.model_executor.layers.fused_moe.RoutedExperts: what FusedMoEFactory builds for ``prefix``."""

    def __init__(self, layer_name: str) -> None:
        self.layer_name = layer_name
        self.moe_config = None


# -- model classes and interfaces
nn = SimpleNamespace(Module=type("Module", (), {}))


class VllmConfig:
    def __init__(self, quant_config: Any) -> None:
        self.quant_config = quant_config


class SupportsPP:
    pass


class SupportsLoRA:
    pass


class SupportsEagle:
    pass


class SupportsEagle3:
    pass


class SupportsMultiModal:
    pass


class SupportsEncoderCudaGraph:
    pass


class EagleModelMixin:
    pass


class MixtureOfExperts:
    pass


class DeepseekV2MixtureOfExperts(MixtureOfExperts):
    pass


class Glm4MixtureOfExperts(MixtureOfExperts):
    pass


class OnlineQuantizationConfig:
    """vllm.model_executor.layers.quantization.online.base.OnlineQuantizationConfig (annotation only)."""
