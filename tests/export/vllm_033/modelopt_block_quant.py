"""Stand-in for vllm/model_executor/layers/quantization/modelopt_block_quant.py -- NOT vLLM code.

``ModelOptMixedPrecisionConfig.get_quant_method`` imports these two classes (``from
.modelopt_block_quant import ...``) only for the B12X block codecs (iq2_xs, iq2_xxs, q8_0).
"""

from ._stubs import FusedMoEMethodBase, QuantizeMethodBase


class ModelOptBlockQuantLinearMethod(QuantizeMethodBase):
    pass


class ModelOptBlockQuantMoEMethod(FusedMoEMethodBase):
    pass
