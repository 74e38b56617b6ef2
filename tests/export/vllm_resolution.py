"""Which routed-experts modules a checkpoint's ``quantized_layers`` reach in vLLM 0.33.0, by vLLM's own logic.

vLLM 0.33 loads a ModelOpt ``MIXED_PRECISION`` checkpoint with the ``modelopt_mixed`` method
(``ModelOptMixedPrecisionConfig``). Each ``RoutedExperts`` module (what a model's ``FusedMoEFactory``
builds) asks it for a quantize method with its module prefix; ``_resolve_quant_algo`` looks that
prefix up in ``quantized_layers`` (exact key, packed shards, a key under ``prefix.``, any key under the
parent of ``.experts``, gate/up shards), after the model class has renamed the keys through its
``hf_to_vllm_mapper``. A key that names no vLLM module is silently ignored, and the experts it was
meant for are then built unquantized -- so an export has to be checked against vLLM's names, not
against the names it was written with.

Approach: vendored, not imported. The deciding vLLM code is copied verbatim into ``vllm_033/`` (see
its README: file and line ranges of the ``vllm-0.33.0`` wheel, checked by a test against the wheel
when present) and run here unmodified; torch / CUDA types are replaced by recording stand-ins.
Importing it from the wheel instead is not clean: ``vllm.model_executor.layers.quantization.modelopt``
imports torch, ``vllm._C`` kernels, triton-backed MoE oracles, ``vllm.config`` and the platform
detection at module import, the wheel (239 MB) would have to be a test dependency, and only a
stubbed-out import graph would load on a machine without a GPU.

What is re-implemented here (glue, with vLLM 0.33.0 line references), not copied:

* which file the quantization dict comes from (:func:`vllm_quantization_dict`): config.json's
  ``quantization_config``, else ``hf_quant_config.json`` (``transformers_utils/config.py:951-965``);
  for ``modelopt_mixed`` without ``quantized_layers`` there, the ``hf_quant_config.json`` file
  (``model_loader/weight_utils.py:269-279, 352-397``); ``_online_quantization_args`` added as
  ``make_checkpoint_config`` does (``weight_utils.py:231-237``);
* the order of the model's name mappings (:func:`apply_model_mappings`): ``initialize_model`` calls
  ``configure_quant_config`` (``model_loader/utils.py:93-94``) and then instantiates the class, whose
  ``SupportsQuant.__new__`` applies the mapper (``interfaces.py:1267-1275``); Kimi-K2.5 then builds its
  text model ``DeepseekV2ForCausalLM`` through ``init_vllm_registered_model`` -> ``initialize_model``
  (``kimi_k25.py:376-381``, ``models/utils.py:624-643``);
* the routed-experts prefixes (:func:`routed_expert_prefixes`), from each model file's constructors;
* the question ``RoutedExperts`` asks: ``FusedMoEFactory(prefix=...)`` -> ``layer_name = prefix``
  (``fused_moe/layer.py:233, 415-416``) -> ``_get_quant_method(self.layer_name, ...)``
  (``fused_moe/routed_experts.py:165-169, 227-242``) -> ``resolve_quant_method`` ->
  ``quant_config.get_quant_method(layer, prefix)`` (``quantization/base_config.py:295-356``, no online
  quantization configured).

Scope: ModelOpt ``MIXED_PRECISION`` checkpoints (single-format exports use ``exclude_modules`` and other
config classes), routed experts only, tensor / pipeline parallel size 1 (every layer built here).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from vllm_033._stubs import RoutedExperts, VllmConfig
from vllm_033.interfaces import SupportsQuant
from vllm_033.model_arch_config_convertor import ModelArchConfigConvertorBase
from vllm_033.model_loader_utils import configure_quant_config
from vllm_033.modelopt import ModelOptMixedPrecisionConfig
from vllm_033.models import (
    DeepseekV2ForCausalLM,
    DeepseekV3ForCausalLM,
    Glm4MoeForCausalLM,
    KimiK25ForConditionalGeneration,
    LagunaForCausalLM,
    MiniMaxM2ForCausalLM,
    MixtralForCausalLM,
    Qwen3MoeForCausalLM,
    get_mlp_layer_types,
)

__all__ = [
    "MODEL_CLASSES",
    "MODEL_TYPES",
    "ExpertResolution",
    "NotMixedPrecision",
    "Resolution",
    "apply_model_mappings",
    "load_hf_config",
    "resolve",
    "resolve_quantized_layers",
    "routed_expert_prefixes",
    "unmatched_quantized_layers",
    "vllm_quantization_dict",
]

CONFIG_FILE = "config.json"
HF_QUANT_CONFIG_FILE = "hf_quant_config.json"

# model_type -> the vLLM 0.33 class its registry maps the checkpoint's ``architectures`` to
# (model_executor/models/registry.py:94, 124, 154, 168, 181, 203, 487).
MODEL_CLASSES: dict[str, type] = {
    "laguna": LagunaForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "deepseek_v3": DeepseekV3ForCausalLM,
    "glm4_moe": Glm4MoeForCausalLM,
    "kimi_k25": KimiK25ForConditionalGeneration,
    "mixtral": MixtralForCausalLM,
    "minimax_m2": MiniMaxM2ForCausalLM,
}
MODEL_TYPES = tuple(MODEL_CLASSES)


class NotMixedPrecision(ValueError):
    """The checkpoint is not one vLLM loads with ``modelopt_mixed``."""


# ------------------------------------------------------------------------------------------ inputs


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def _namespace(config: Mapping[str, Any]) -> SimpleNamespace:
    """The attributes of transformers' config object that vLLM's quantization lookup reads."""
    ns = SimpleNamespace()
    if "quantization_config" in config:
        ns.quantization_config = config["quantization_config"]
    if isinstance(config.get("text_config"), Mapping):
        ns.text_config = _namespace(config["text_config"])
    return ns


def vllm_quantization_dict(export_dir: Path) -> tuple[dict[str, Any], str]:
    """The quantization dict vLLM 0.33 builds its ``modelopt_mixed`` config from, and its file.

    1. ``get_config`` sets ``hf_config.quantization_config`` from config.json's ``quantization_config``,
       else from ``hf_quant_config.json`` (transformers_utils/config.py:951-965).
    2. ``ModelArchConfigConvertorBase.get_quantization_config`` normalises it (vendored: sets
       ``quant_method`` from a ``producer.name == "modelopt"`` config's ``quantization.quant_algo``), and
       ``ModelConfig._verify_quantization`` asks each method's ``override_quantization_method``; only
       ``ModelOptMixedPrecisionConfig``'s answers MIXED_PRECISION (config/model.py:1383-1450).
    3. ``get_quant_config`` uses ``hf_config.quantization_config`` if it has ``quantized_layers``, else the
       checkpoint's one ``*hf_quant_config.json``, which must then name ``producer.name == "modelopt"``
       (model_loader/weight_utils.py:239-279, 352-397).

    Raises :class:`NotMixedPrecision` when vLLM would not pick ``modelopt_mixed`` and ``ValueError`` where
    vLLM raises.
    """
    export_dir = Path(export_dir)
    config = _read_json(export_dir / CONFIG_FILE)
    hf_quant_config_path = export_dir / HF_QUANT_CONFIG_FILE
    hf_config = _namespace(config)
    source = CONFIG_FILE
    if getattr(hf_config, "quantization_config", None) is None and hf_quant_config_path.exists():
        hf_config.quantization_config = _read_json(hf_quant_config_path)
        source = HF_QUANT_CONFIG_FILE
    quant = ModelArchConfigConvertorBase(hf_config).get_quantization_config()
    if quant is None:
        raise NotMixedPrecision(f"{export_dir}: no quantization config")
    if getattr(hf_config, "quantization_config", None) is None:
        source = f"text_config in {CONFIG_FILE}"
    if ModelOptMixedPrecisionConfig.override_quantization_method(quant, None) != "modelopt_mixed":
        raise NotMixedPrecision(
            f"{export_dir}: vLLM would not load {source} as modelopt_mixed "
            f"(quant_method {quant.get('quant_method')!r}, "
            f"quant_algo {ModelOptMixedPrecisionConfig._extract_modelopt_quant_algo(quant)!r})"
        )
    if "quantized_layers" in quant:
        return quant, source
    files = sorted(p for p in export_dir.glob("*.json") if p.name.endswith(HF_QUANT_CONFIG_FILE))
    if len(files) != 1:
        raise ValueError(f"{export_dir}: {len(files)} *{HF_QUANT_CONFIG_FILE} files for modelopt_mixed")
    file_config = _read_json(files[0])
    if file_config.get("producer", {}).get("name") != "modelopt":
        raise ValueError(f"Unsupported quantization config found for modelopt_mixed in {files[0]}.")
    return file_config, files[0].name


def load_hf_config(export_dir: Path) -> Any:
    """The transformers config vLLM builds the model from (``AutoConfig``, local directory, no network).

    vLLM 0.33 uses transformers' own classes for these model types (``kimi_k25`` -> upstream
    ``Kimi_K25Config``, transformers_utils/config.py:144), so class defaults for keys a config.json
    omits (``decoder_sparse_step``, ``first_k_dense_replace``, ...) are the same here.
    """
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(export_dir))


# ----------------------------------------------------------------------------- the model's modules


def _text_config(hf_config: Any) -> Any:
    # ModelConfig.hf_text_config = get_hf_text_config(hf_config) (transformers_utils/config.py:1258-1272)
    return hf_config.get_text_config()


def routed_expert_prefixes(hf_config: Any, model_type: str | None = None) -> dict[int, str]:
    """``{layer: prefix}`` of every ``RoutedExperts`` module vLLM 0.33 builds for this config.

    Each model class is built with ``prefix=""``; ``maybe_prefix("", "model") == "model"``
    (models/utils.py:971-982) and ``make_layers`` names layer ``i`` ``f"{prefix}.layers.{i}"``
    (models/utils.py:912-916). The MoE-layer rule and the names below each layer are the model file's:
    """
    model_type = model_type or hf_config.model_type
    if model_type == "laguna":
        # laguna.py:711-712 model; 614-623 layers; 517-520 is_moe_layer =
        #   get_mlp_layer_types(config)[layer_idx] == "sparse" and config.num_experts > 0;
        # 523-527 LagunaMoE(prefix=f"{prefix}.mlp"); 214-222 FusedMoEFactory(prefix=f"{prefix}.experts")
        config, root = hf_config, "model.layers"
        types = get_mlp_layer_types(config)
        moe = [i for i in range(config.num_hidden_layers) if types[i] == "sparse" and config.num_experts > 0]
        block = "mlp"
    elif model_type == "qwen3_moe":
        # qwen3_moe.py:577-578 model; 474-477 layers; config = hf_text_config (360); 386-392
        #   (layer_idx not in mlp_only_layers) and (config.num_experts > 0 and
        #   (layer_idx + 1) % config.decoder_sparse_step == 0), mlp_only_layers = [] when absent;
        # 393-395 Qwen3MoeSparseMoeBlock(prefix=f"{prefix}.mlp"); 203-212 prefix=f"{prefix}.experts"
        config, root = _text_config(hf_config), "model.layers"
        only = [] if not hasattr(config, "mlp_only_layers") else config.mlp_only_layers
        moe = [
            i
            for i in range(config.num_hidden_layers)
            if i not in only and config.num_experts > 0 and (i + 1) % config.decoder_sparse_step == 0
        ]
        block = "mlp"
    elif model_type in ("deepseek_v3", "kimi_k25"):
        # deepseek_v2.py:1914-1915 model; 1468-1476 layers; 1269 moe_layer_freq = getattr(config,
        #   "moe_layer_freq", 1); 1293-1297 is_moe_layer = config.n_routed_experts is not None and
        #   layer_idx >= config.first_k_dense_replace and layer_idx % moe_layer_freq == 0;
        # 1329-1334 DeepseekV2MoE(prefix=f"{prefix}.mlp"); 374-386 prefix=f"{prefix}.experts".
        # kimi_k25.py:376-381: the text model is DeepseekV2ForCausalLM(config.text_config) built with
        #   prefix "language_model".
        if model_type == "kimi_k25":
            config, root = hf_config.text_config, "language_model.model.layers"
        else:
            config, root = hf_config, "model.layers"
        freq = getattr(config, "moe_layer_freq", 1)
        moe = [
            i
            for i in range(config.num_hidden_layers)
            if config.n_routed_experts is not None and i >= config.first_k_dense_replace and i % freq == 0
        ]
        block = "mlp"
    elif model_type == "glm4_moe":
        # glm4_moe.py:555-556 model; 435-444 layers; 353-356 config.n_routed_experts is not None and
        #   layer_idx >= config.first_k_dense_replace; 357-360 Glm4MoE(prefix=f"{prefix}.mlp");
        # 183-194 prefix=f"{prefix}.experts"
        config, root = hf_config, "model.layers"
        moe = [
            i
            for i in range(config.num_hidden_layers)
            if config.n_routed_experts is not None and i >= config.first_k_dense_replace
        ]
        block = "mlp"
    elif model_type == "mixtral":
        # mixtral.py:402-403 model; 324-333 layers; every layer: 246-253
        #   MixtralMoE(prefix=f"{prefix}.block_sparse_moe"); 118-128 prefix=f"{prefix}.experts"
        config, root = hf_config, "model.layers"
        moe = list(range(config.num_hidden_layers))
        block = "block_sparse_moe"
    elif model_type == "minimax_m2":
        # minimax_m2.py:446-447 model; 354-363 layers; every layer: 285-289
        #   self.block_sparse_moe = MiniMaxM2MoE(prefix=f"{prefix}.mlp") -- the attribute is
        #   block_sparse_moe, the prefix it passes down is ".mlp"; 96-105 prefix=f"{prefix}.experts"
        config, root = hf_config, "model.layers"
        moe = list(range(config.num_hidden_layers))
        block = "mlp"
    else:
        raise ValueError(f"model_type {model_type!r} not covered; known: {MODEL_TYPES}")
    return {i: f"{root}.{i}.{block}.experts" for i in moe}


def apply_model_mappings(quant_config: Any, model_type: str) -> None:
    """Rename ``quant_config``'s layer names as vLLM 0.33 does while it builds ``model_type``'s model.

    ``initialize_model`` runs ``configure_quant_config(quant_config, model_class)`` (applies the class's
    ``hf_to_vllm_mapper.get_rename_mapper()`` unless it is a ``SupportsQuant``) and then instantiates the
    class: ``SupportsQuant.__new__`` applies the mapper of ``SupportsQuant`` models (model_loader/utils.py:
    93-101, interfaces.py:1267-1299). Kimi-K2.5 then initialises its ``DeepseekV2ForCausalLM`` text model
    the same way (kimi_k25.py:376-381).
    """
    model_class = MODEL_CLASSES[model_type]
    configure_quant_config(quant_config, model_class)
    if issubclass(model_class, SupportsQuant):
        # model_class(vllm_config=vllm_config, prefix=prefix) runs __new__ before __init__.
        model_class.__new__(model_class, vllm_config=VllmConfig(quant_config), prefix="")
    if model_type == "kimi_k25":
        configure_quant_config(quant_config, DeepseekV2ForCausalLM)


# ------------------------------------------------------------------------------------- resolution


class _Reads:
    """Which ``quantized_layers`` entries vLLM reads ``quant_algo`` from, while recording is on."""

    def __init__(self) -> None:
        self.on = False
        self.keys: list[str] = []


class _Entry(dict):
    """A ``quantized_layers`` value that remembers its checkpoint key and notes each read of it."""

    def __init__(self, key: str, info: Mapping[str, Any], reads: _Reads) -> None:
        super().__init__(info)
        self.key = key
        self._reads = reads

    def __getitem__(self, item: str) -> Any:
        if self._reads.on:
            self._reads.keys.append(self.key)
        return super().__getitem__(item)


@dataclass(frozen=True)
class ExpertResolution:
    """One ``RoutedExperts`` module: what vLLM 0.33 quantizes it with.

    ``algo``: ``_resolve_quant_algo(prefix)`` (upper-cased ``quant_algo`` or None); ``method``: class name
    of ``get_quant_method(layer, prefix)`` (None: vLLM falls back to ``UnquantizedFusedMoEMethod``,
    routed_experts.py:238-241); ``keys``: the checkpoint ``quantized_layers`` keys it was decided by.
    """

    layer: int
    prefix: str
    algo: str | None
    method: str | None
    keys: tuple[str, ...]

    @property
    def quantized_as(self) -> str | None:
        """The algo vLLM builds the experts with; None when it builds them unquantized."""
        return self.algo if self.method is not None else None


@dataclass(frozen=True)
class Resolution:
    model_type: str
    source: str  # the file vLLM takes quantized_layers from
    quantized_layers: dict[str, Any]  # as written in that file
    experts: tuple[ExpertResolution, ...]
    unmatched: tuple[str, ...]  # keys no routed-experts module of the model reads
    architecture: str | None = field(default=None)  # config.json architectures[0]

    @property
    def by_prefix(self) -> dict[str, str | None]:
        return {e.prefix: e.quantized_as for e in self.experts}


def resolve(export_dir: Path, model_type: str | None = None, hf_config: Any = None) -> Resolution:
    """Run vLLM 0.33's ``modelopt_mixed`` resolution for every routed-experts module of the export.

    ``model_type`` defaults to config.json's (and must match it when given); ``hf_config`` (the
    transformers config) defaults to :func:`load_hf_config`. Raises :class:`NotMixedPrecision` for a
    checkpoint vLLM would not load with ``modelopt_mixed``, and whatever vLLM's config parsing raises
    (``ValueError``) for one it would reject.
    """
    export_dir = Path(export_dir)
    config = _read_json(export_dir / CONFIG_FILE)
    if model_type is not None and config.get("model_type") != model_type:
        raise ValueError(
            f"{export_dir}: config.json model_type is {config.get('model_type')!r}, not {model_type!r}"
        )
    model_type = config.get("model_type")
    if model_type not in MODEL_CLASSES:
        raise ValueError(f"{export_dir}: model_type {model_type!r} not covered; known: {MODEL_TYPES}")
    quant, source = vllm_quantization_dict(export_dir)
    if hf_config is None:
        hf_config = load_hf_config(export_dir)

    # weight_utils.py:231-237 make_checkpoint_config -> ModelOptQuantConfigBase.from_config
    quant_config = ModelOptMixedPrecisionConfig.from_config({**quant, "_online_quantization_args": None})
    written = dict(quant_config.quantized_layers)
    reads = _Reads()
    quant_config.quantized_layers = {k: _Entry(k, v, reads) for k, v in written.items()}
    apply_model_mappings(quant_config, model_type)

    experts = []
    used: set[str] = set()
    for layer, prefix in routed_expert_prefixes(hf_config, model_type).items():
        reads.on, reads.keys = True, []
        method = quant_config.get_quant_method(RoutedExperts(prefix), prefix)
        reads.on = False
        keys = tuple(dict.fromkeys(reads.keys))
        used.update(keys)
        algo = quant_config._resolve_quant_algo(prefix)
        name = None if method is None else type(method).__name__
        experts.append(ExpertResolution(layer, prefix, algo, name, keys))
    architectures = config.get("architectures") or [None]
    return Resolution(
        model_type=model_type,
        source=source,
        quantized_layers=written,
        experts=tuple(experts),
        unmatched=tuple(k for k in written if k not in used),
        architecture=architectures[0],
    )


def resolve_quantized_layers(export_dir: Path, model_type: str | None = None) -> dict[str, str | None]:
    """``{vLLM routed-experts prefix: quant algo vLLM builds it with, or None (unquantized)}``."""
    return resolve(export_dir, model_type).by_prefix


def unmatched_quantized_layers(export_dir: Path, model_type: str | None = None) -> list[str]:
    """``quantized_layers`` keys that no routed-experts module of the model reads (empty for a good export).

    A key is matched when vLLM reads its entry while choosing some routed-experts module's quantize
    method. Keys meant for other modules (a linear layer) are reported too: this project quantizes only
    routed experts. When several keys fall under one experts prefix, vLLM reads only the first.
    """
    return list(resolve(export_dir, model_type).unmatched)
