"""The class-level attributes the quantization config reads from each model class (bases,
``hf_to_vllm_mapper``, ``packed_modules_mapping``), and Laguna's ``get_mlp_layer_types``.
Only the class statements and their attribute blocks are copied (``@support_torch_compile``
decorators and every method omitted); the bases other than ``SupportsQuant`` are empty stand-ins.

Verbatim excerpts of vLLM 0.33.0 (PyPI wheel vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl,
sha256 4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa).
Each excerpt sits between ``# >>> vllm 0.33.0 <file>:<first>-<last>`` and ``# <<< ...`` markers
and is byte-identical to those lines of the wheel's file, except lines ending in
``# replaced import`` (an import of vLLM replaced by the local stand-in). Everything outside the
markers (this docstring, the imports, ``_stubs``) is not vLLM code. See README.md;
tests/export/test_vllm_resolution.py re-checks the excerpts against the wheel when it is available.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from ._stubs import (
    DeepseekV2MixtureOfExperts,
    EagleModelMixin,
    Glm4MixtureOfExperts,
    MixtureOfExperts,
    SupportsEagle,
    SupportsEagle3,
    SupportsEncoderCudaGraph,
    SupportsLoRA,
    SupportsMultiModal,
    SupportsPP,
    nn,
)
from .interfaces import SupportsQuant
from .models_utils import WeightsMapper


# fmt: off
# >>> vllm 0.33.0 vllm/model_executor/models/laguna.py:59-67
def get_mlp_layer_types(config) -> list[str]:
    """Return which layers are MoE, rejecting configs predating Transformers support."""
    mlp_layer_types = getattr(config, "mlp_layer_types", None)
    if mlp_layer_types is None:
        raise ValueError(
            "Laguna requires the `LagunaConfig` from Transformers, which is "
            "available from v5.17.0. Please update Transformers to run this model."
        )
    return mlp_layer_types
# <<< vllm 0.33.0 vllm/model_executor/models/laguna.py:59-67
# fmt: on


# fmt: off
# >>> vllm 0.33.0 vllm/model_executor/models/laguna.py:569-576
class LagunaModel(nn.Module, EagleModelMixin):
    hf_to_vllm_mapper = WeightsMapper(
        orig_to_new_stacked={
            ".q_proj": (".qkv_proj", "q"),
            ".k_proj": (".qkv_proj", "k"),
            ".v_proj": (".qkv_proj", "v"),
        }
    )
# <<< vllm 0.33.0 vllm/model_executor/models/laguna.py:569-576
# fmt: on


# fmt: off
# >>> vllm 0.33.0 vllm/model_executor/models/laguna.py:697-702
class LagunaForCausalLM(nn.Module, SupportsPP, SupportsLoRA, SupportsEagle3):
    fall_back_to_pt_during_load = False

    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    }
# <<< vllm 0.33.0 vllm/model_executor/models/laguna.py:697-702
# fmt: on


# fmt: off
# >>> vllm 0.33.0 vllm/model_executor/models/qwen3_moe.py:435-448
class Qwen3MoeModel(nn.Module, EagleModelMixin):
    hf_to_vllm_mapper = WeightsMapper(
        orig_to_new_stacked={
            # weight_name: (param_name, shard_id)
            ".q_proj": (".qkv_proj", "q"),
            ".k_proj": (".qkv_proj", "k"),
            ".v_proj": (".qkv_proj", "v"),
            # .experts.gate_up_proj must be handled by MoERunner.load_weights for EP
            ".mlp.gate_proj": (".mlp.gate_up_proj", 0),
            ".mlp.up_proj": (".mlp.gate_up_proj", 1),
            ".shared_expert.gate_proj": (".shared_expert.gate_up_proj", 0),
            ".shared_expert.up_proj": (".shared_expert.gate_up_proj", 1),
        }
    )
# <<< vllm 0.33.0 vllm/model_executor/models/qwen3_moe.py:435-448
# fmt: on


# fmt: off
# >>> vllm 0.33.0 vllm/model_executor/models/qwen3_moe.py:543-566
class Qwen3MoeForCausalLM(
    nn.Module,
    SupportsPP,
    SupportsLoRA,
    SupportsEagle,
    SupportsEagle3,
    MixtureOfExperts,
    SupportsQuant,
):
    hf_to_vllm_mapper = Qwen3MoeModel.hf_to_vllm_mapper
    packed_modules_mapping = {
        "qkv_proj": [
            "q_proj",
            "k_proj",
            "v_proj",
        ]
    }

    embedding_modules = {
        "embed_tokens": "input_embeddings",
        "lm_head": "output_embeddings",
    }

    fall_back_to_pt_during_load = False
# <<< vllm 0.33.0 vllm/model_executor/models/qwen3_moe.py:543-566
# fmt: on


# fmt: off
# >>> vllm 0.33.0 vllm/model_executor/models/deepseek_v2.py:1427-1428
class DeepseekV2Model(nn.Module):
    fall_back_to_pt_during_load = False
# <<< vllm 0.33.0 vllm/model_executor/models/deepseek_v2.py:1427-1428
# fmt: on


# fmt: off
# >>> vllm 0.33.0 vllm/model_executor/models/deepseek_v2.py:1872-1883
class DeepseekV2ForCausalLM(
    nn.Module,
    SupportsPP,
    DeepseekV2MixtureOfExperts,
    SupportsLoRA,
    SupportsEagle,
    SupportsEagle3,
):
    packed_modules_mapping = {
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    model_cls = DeepseekV2Model
# <<< vllm 0.33.0 vllm/model_executor/models/deepseek_v2.py:1872-1883
# fmt: on


# fmt: off
# >>> vllm 0.33.0 vllm/model_executor/models/deepseek_v2.py:2005-2006
class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    pass
# <<< vllm 0.33.0 vllm/model_executor/models/deepseek_v2.py:2005-2006
# fmt: on


# fmt: off
# >>> vllm 0.33.0 vllm/model_executor/models/glm4_moe.py:403-415
class Glm4MoeModel(nn.Module):
    hf_to_vllm_mapper = WeightsMapper(
        orig_to_new_stacked={
            ".q_proj": (".qkv_proj", "q"),
            ".k_proj": (".qkv_proj", "k"),
            ".v_proj": (".qkv_proj", "v"),
            # .experts.gate_up_proj must be handled by MoERunner.load_weights for EP
            ".mlp.gate_proj": (".mlp.gate_up_proj", 0),
            ".mlp.up_proj": (".mlp.gate_up_proj", 1),
            ".shared_experts.gate_proj": (".shared_experts.gate_up_proj", 0),
            ".shared_experts.up_proj": (".shared_experts.gate_up_proj", 1),
        }
    )
# <<< vllm 0.33.0 vllm/model_executor/models/glm4_moe.py:403-415
# fmt: on


# fmt: off
# >>> vllm 0.33.0 vllm/model_executor/models/glm4_moe.py:534-547
class Glm4MoeForCausalLM(nn.Module, SupportsPP, SupportsLoRA, Glm4MixtureOfExperts):
    packed_modules_mapping = {
        "qkv_proj": [
            "q_proj",
            "k_proj",
            "v_proj",
        ],
        "gate_up_proj": [
            "gate_proj",
            "up_proj",
        ],
    }

    fall_back_to_pt_during_load = False
# <<< vllm 0.33.0 vllm/model_executor/models/glm4_moe.py:534-547
# fmt: on


# fmt: off
# >>> vllm 0.33.0 vllm/model_executor/models/kimi_k25.py:291-320
class KimiK25ForConditionalGeneration(
    nn.Module,
    SupportsMultiModal,
    SupportsPP,
    SupportsQuant,
    SupportsEagle,
    SupportsEagle3,
    SupportsEncoderCudaGraph,
):
    """Kimi-K2.5 model for conditional generation.

    Supports both image and video-chunk modalities.
    Video-chunks are temporal segments (typically 4 frames) that are
    processed with temporal pooling.
    """

    supports_encoder_tp_data = True
    supports_encoder_cudagraph: ClassVar[Literal[True]] = True
    supports_mm_device_do_normalize = True

    hf_to_vllm_mapper = WeightsMapper(
        orig_to_new_prefix={
            # For legacy NVFP4 checkpoint compatibility:
            # see https://github.com/vllm-project/vllm/pull/33346#issuecomment-3851475033
            "language_model.layers.": "language_model.model.layers.",
            # mm projector
            "mm_projector.proj.0": "mm_projector.linear_1",
            "mm_projector.proj.2": "mm_projector.linear_2",
        }
    )
# <<< vllm 0.33.0 vllm/model_executor/models/kimi_k25.py:291-320
# fmt: on


# fmt: off
# >>> vllm 0.33.0 vllm/model_executor/models/mixtral.py:284-299
class MixtralModel(nn.Module):
    hf_to_vllm_mapper = WeightsMapper(
        orig_to_new_stacked={
            # weight_name: (param_name, shard_id)
            ".q_proj": (".qkv_proj", "q"),
            ".k_proj": (".qkv_proj", "k"),
            ".v_proj": (".qkv_proj", "v"),
        },
        orig_to_new_substr={
            # W8A8 compressed-tensors checkpoints name experts gate/up/down;
            # map to the w1/w3/w2 the FusedMoE loader expects (no-op if native).
            ".gate_proj.": ".w1.",
            ".up_proj.": ".w3.",
            ".down_proj.": ".w2.",
        },
    )
# <<< vllm 0.33.0 vllm/model_executor/models/mixtral.py:284-299
# fmt: on


# fmt: off
# >>> vllm 0.33.0 vllm/model_executor/models/mixtral.py:375-391
class MixtralForCausalLM(nn.Module, SupportsLoRA, SupportsPP, MixtureOfExperts):
    fall_back_to_pt_during_load = False

    hf_to_vllm_mapper = MixtralModel.hf_to_vllm_mapper
    packed_modules_mapping = {
        "qkv_proj": [
            "q_proj",
            "k_proj",
            "v_proj",
        ],
    }

    # LoRA specific attributes
    embedding_modules = {
        "embed_tokens": "input_embeddings",
        "lm_head": "output_embeddings",
    }
# <<< vllm 0.33.0 vllm/model_executor/models/mixtral.py:375-391
# fmt: on


# fmt: off
# >>> vllm 0.33.0 vllm/model_executor/models/minimax_m2.py:321-331
class MiniMaxM2Model(nn.Module, EagleModelMixin):
    fall_back_to_pt_during_load = False

    hf_to_vllm_mapper = WeightsMapper(
        orig_to_new_stacked={
            # weight_name: (param_name, shard_id)
            ".q_proj": (".qkv_proj", "q"),
            ".k_proj": (".qkv_proj", "k"),
            ".v_proj": (".qkv_proj", "v"),
        }
    )
# <<< vllm 0.33.0 vllm/model_executor/models/minimax_m2.py:321-331
# fmt: on


# fmt: off
# >>> vllm 0.33.0 vllm/model_executor/models/minimax_m2.py:428-436
class MiniMaxM2ForCausalLM(nn.Module, SupportsLoRA, SupportsPP, SupportsEagle3):
    hf_to_vllm_mapper = MiniMaxM2Model.hf_to_vllm_mapper
    packed_modules_mapping = {
        "qkv_proj": [
            "q_proj",
            "k_proj",
            "v_proj",
        ],
    }
# <<< vllm 0.33.0 vllm/model_executor/models/minimax_m2.py:428-436
# fmt: on
