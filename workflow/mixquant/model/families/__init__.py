"""MoE families: everything architecture-specific, in one place.

mixquant works on the routed experts of a transformers MoE model whose experts module keeps them fused
(``@use_experts_implementation``: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``, gate rows first).
What differs between families is *derived from transformers*, not written down here:

* which decoder layers are MoE, the experts module of each, its expert count: from the model class built
  on the meta device from the checkpoint's config.json (no weights);
* the checkpoint's (disk) tensor names and shapes: transformers' own reverse conversion of that meta
  model's state dict (``revert_weight_conversion``, what ``save_pretrained`` writes), and which disk
  tensor of an expert is its gate / up / down projection: the model's conversion mapping (the converter
  building ``experts.gate_up_proj`` lists the gate source first, then up).

A family module (``laguna``, ``qwen3_moe``, ``deepseek_v3``, ``mixtral``) names the ``model_type``\\ s it
covers and what cannot be derived: the source checkpoint formats its publishers use (block-FP8 sources
are dequantized first, :mod:`mixquant.checkpoint.fp8_source`). :func:`architecture` is the one entry point:
an unsupported ``model_type`` stops with one line naming it and the supported ones.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from mixquant.jsonio import read_json, write_json_atomic
from mixquant.model.families import deepseek_v3, laguna, mixtral, qwen3_moe

__all__ = [
    "DEFAULT_EXPERT_TEMPLATES",
    "DEFAULT_EXPERT_WEIGHT",
    "DEFAULT_MODEL_TYPE",
    "FAMILIES",
    "PROJECTIONS",
    "Architecture",
    "UnsupportedArchitecture",
    "architecture",
    "cache_architectures",
    "workflow_cache",
    "default_expert_weight",
    "experts_module_name",
    "experts_of",
    "family_of",
    "mlp_layer_types",
    "moe_experts",
]

FAMILIES = (laguna, qwen3_moe, deepseek_v3, mixtral)
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # mixquant's names of an expert's three weights
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
# transformers' in-memory module path of a layer's routed experts: the same in every family (ModelOpt's
# quantized layer; the disk names differ, see expert_templates)
EXPERTS_MODULE = "model.layers.{layer}.mlp.experts"


class UnsupportedArchitecture(ValueError):
    """A model type no family covers (one line naming it and the supported ones)."""


def supported_model_types() -> list[str]:
    return sorted(t for family in FAMILIES for t in family.MODEL_TYPES)


def family_of(model_type: str):
    """The family module covering ``model_type``."""
    for family in FAMILIES:
        if model_type in family.MODEL_TYPES:
            return family
    raise UnsupportedArchitecture(
        f"model_type {model_type!r} is not supported; supported: {', '.join(supported_model_types())}"
    )


@dataclass(frozen=True)
class Architecture:
    """What mixquant needs to know of one model (a config.json), derived from transformers' classes.

    ``tensors``: every checkpoint tensor as the upstream layout names it, with its shape (in the model's
    dtype); ``expert_weights[(layer, expert, proj)]``: the disk name of one routed-expert weight.
    """

    model_type: str
    family: str
    moe_layers: tuple[int, ...]
    num_experts: int
    experts_per_token: int
    num_hidden_layers: int
    dtype: str
    tensors: Mapping[str, tuple[tuple[int, ...], str]] = field(repr=False)  # name -> (shape, torch dtype)
    expert_templates: Mapping[str, str] = field(repr=False)  # proj -> "...{layer}...{expert}..."
    experts_module_template: str = EXPERTS_MODULE
    source_formats: tuple[str, ...] = ("bf16",)
    # whether the export's FP8 KV-cache scales (k_proj.k_scale / v_proj.v_scale) are validated for the family
    kv_cache_scales: bool = False
    # (ModelOpt's quantized_layers key, vLLM's) templates where vLLM resolves another key (the family's)
    vllm_key_rewrite: tuple[str, str] | None = None

    def vllm_quantized_layers(self, quantized_layers: Mapping[str, Any]) -> dict[str, Any]:
        """``quantized_layers`` with ModelOpt's keys as the serving engine (vLLM 0.33) resolves them."""
        if self.vllm_key_rewrite is None:
            return dict(quantized_layers)
        modelopt, vllm = self.vllm_key_rewrite
        rewrites = {modelopt.format(layer=layer): vllm.format(layer=layer) for layer in self.moe_layers}
        return {rewrites.get(key, key): value for key, value in quantized_layers.items()}

    def experts_module(self, layer: int) -> str:
        """The in-memory module path of MoE layer ``layer``'s routed experts (ModelOpt's quantized layer)."""
        return self.experts_module_template.format(layer=int(layer))

    def expert_weight(self, layer: int, expert: int, proj: str) -> str:
        """The disk name of routed expert ``expert``'s ``proj`` weight (gate_proj / up_proj / down_proj)."""
        return self.expert_templates[proj].format(layer=int(layer), expert=int(expert))

    def expert_prefix(self, layer: int, expert: int, proj: str) -> str:
        return self.expert_weight(layer, expert, proj).removesuffix(".weight")

    def routed_expert_of(self, name: str) -> tuple[int, int, str] | None:
        """``(layer, expert, proj)`` of a disk tensor name that is a routed-expert weight or its scale."""
        for proj, pattern in _routed_patterns(tuple(sorted(self.expert_templates.items()))):
            match = pattern.match(name)
            if match:
                return int(match.group("layer")), int(match.group("expert")), proj
        return None

    def is_moe_layer(self, layer: int) -> bool:
        return int(layer) in self.moe_layers

    def expert_shape(self, proj: str) -> tuple[int, ...]:
        """The ``[out, in]`` shape of an expert's ``proj`` weight (the same in every MoE layer)."""
        return self.tensors[self.expert_weight(self.moe_layers[0], 0, proj)][0]

    @property
    def routed_params_per_layer(self) -> int:
        per_expert = sum(math.prod(self.expert_shape(proj)) for proj in PROJECTIONS)
        return self.num_experts * per_expert

    def non_expert_tensors(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Every checkpoint tensor but the routed-expert weights (name -> (shape, torch dtype))."""
        return {n: v for n, v in self.tensors.items() if self.routed_expert_of(n) is None}


@lru_cache(maxsize=32)
def _routed_patterns(templates: tuple[tuple[str, str], ...]) -> tuple[tuple[str, re.Pattern], ...]:
    """Per projection, a regex of its tensors (the weight and its scales) from the disk name template."""
    out = []
    for proj, template in templates:
        body = re.escape(template.removesuffix(".weight"))
        body = body.replace(re.escape("{layer}"), r"(?P<layer>\d+)").replace(
            re.escape("{expert}"), r"(?P<expert>\d+)"
        )
        out.append((proj, re.compile(rf"^{body}\.[A-Za-z_0-9]+$")))
    return tuple(out)


def _dtype_name(config: Mapping[str, Any]) -> str:
    return str(config.get("dtype") or config.get("torch_dtype") or "bfloat16")


@lru_cache(maxsize=8)
def _architecture(config_json: str) -> Architecture:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, revert_weight_conversion

    config = json.loads(config_json)
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise UnsupportedArchitecture("config.json has no model_type")
    family = family_of(model_type)
    clean = {k: v for k, v in config.items() if k != "quantization_config"}
    hf_config = AutoConfig.for_model(**clean)
    dtype = getattr(torch, _dtype_name(config))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    found = moe_experts(model)
    moe_layers = sorted(found)
    num_experts = int(found[moe_layers[-1]].num_experts) if moe_layers else None
    if not moe_layers:
        raise UnsupportedArchitecture(f"model_type {model_type!r}: this config has no MoE layer")
    conversions = get_model_conversion_mapping(model)
    model._weight_conversions = conversions
    disk = revert_weight_conversion(model, model.state_dict())
    tensors = {
        name: (tuple(int(d) for d in tensor.shape), str(tensor.dtype).removeprefix("torch."))
        for name, tensor in disk.items()
    }
    templates = _expert_templates(conversions, WeightConverter, tensors, moe_layers[0])
    return Architecture(
        model_type=model_type,
        family=family.NAME,
        moe_layers=tuple(moe_layers),
        num_experts=int(num_experts),
        experts_per_token=int(hf_config.num_experts_per_tok),
        num_hidden_layers=len(model.model.layers),
        dtype=_dtype_name(config),
        tensors=tensors,
        expert_templates=templates,
        source_formats=tuple(family.SOURCE_FORMATS),
        kv_cache_scales=bool(getattr(family, "KV_CACHE_SCALES", False)),
        vllm_key_rewrite=getattr(family, "VLLM_QUANTIZED_LAYER_KEYS", {}).get(model_type),
    )


def moe_experts(model: Any) -> dict[int, Any]:
    """``{layer: routed-experts module}`` of a transformers model of any family (loaded, streamed or on the
    meta device): the decoder layers whose experts module holds fused ``gate_up_proj`` weights."""
    found = {}
    for index, layer in enumerate(model.model.layers):
        experts = getattr(getattr(layer, "mlp", None), "experts", None)
        if experts is not None and hasattr(experts, "gate_up_proj"):
            found[index] = experts
    return found


def experts_module_name(layer: int) -> str:
    """The in-memory module path of MoE layer ``layer``'s routed experts, in every family."""
    return EXPERTS_MODULE.format(layer=int(layer))


def experts_of(model: Any, layer: int) -> Any:
    """The routed-experts module of MoE layer ``layer`` of a transformers model."""
    return model.get_submodule(experts_module_name(layer))


def _expert_templates(conversions, converter_type, tensors: Mapping[str, Any], layer: int) -> dict[str, str]:
    """proj -> disk name template of a routed-expert weight, from the converters that build the fused
    ``experts.gate_up_proj`` (sources: gate, then up) and ``experts.down_proj``, matched against the
    reverted disk names of ``layer``'s expert 0."""
    sources: dict[str, str] = {}
    for conversion in conversions:
        if not isinstance(conversion, converter_type):
            continue
        targets = " ".join(conversion.target_patterns)
        patterns = list(conversion.source_patterns)
        if targets.endswith("experts.gate_up_proj") and len(patterns) == 2:
            sources["gate_proj"], sources["up_proj"] = patterns
        elif targets.endswith("experts.down_proj") and len(patterns) == 1:
            sources["down_proj"] = patterns[0]
    if set(sources) != set(PROJECTIONS):
        raise UnsupportedArchitecture(f"no per-expert conversion for the fused experts ({sorted(sources)})")
    prefix = f"model.layers.{layer}."
    templates = {}
    for proj, source in sources.items():
        suffix = source.split("*", 1)[1]  # e.g. ".gate_proj.weight" or ".w1.weight"
        found = [n for n in tensors if n.startswith(prefix) and n.endswith(suffix) and ".0" + suffix in n]
        if len(found) != 1:
            raise UnsupportedArchitecture(
                f"expert 0's {proj} of layer {layer} is not one disk tensor: {found}"
            )
        name = found[0]
        head = name[: -len("0" + suffix)]
        templates[proj] = head.replace(prefix, "model.layers.{layer}.", 1) + "{expert}" + suffix
    return templates


def architecture(config: Mapping[str, Any] | str | Path) -> Architecture:
    """The :class:`Architecture` of a config.json (a dict, a path to the file or to its directory)."""
    if not isinstance(config, Mapping):
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        config = read_json(path, "config.json", error=UnsupportedArchitecture, max_bytes=1 << 20)
        if not isinstance(config, dict):
            raise UnsupportedArchitecture(f"{path}: config.json is not a JSON object")
    check_sizes(config)
    return _cached_architecture(json.dumps(config, sort_keys=True))


# --------------------------------------------------------------------- a checkpoint without a model_type

# What a checkpoint directory whose config.json names no model_type is read with: the qwen2_moe-style
# expert names (Laguna, Qwen3-MoE, DeepSeek-V3, GLM) and Laguna's MLP layer types; otherwise the family's
# own names (Architecture.expert_weight). A planning-time geometry without a model_type is that family's.
DEFAULT_MODEL_TYPE = laguna.MODEL_TYPES[0]
DEFAULT_EXPERT_TEMPLATES = {
    p: f"model.layers.{{layer}}.mlp.experts.{{expert}}.{p}.weight" for p in PROJECTIONS
}
DEFAULT_EXPERT_WEIGHT = re.compile(
    r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$"
)


def default_expert_weight(layer: int, expert: int, proj: str) -> str:
    """Upstream name of one routed-expert weight in the qwen2_moe-style layout (Laguna's):
    ``model.layers.L.mlp.experts.E.{proj}.weight``."""
    return DEFAULT_EXPERT_TEMPLATES[proj].format(layer=int(layer), expert=int(expert))


def _cfg(config: Any, key: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def mlp_layer_types(config: Any) -> list[str]:
    """Per-layer "dense"/"sparse", with Laguna's default (first layer dense, rest sparse)."""
    layers = int(_cfg(config, "num_hidden_layers"))
    types = _cfg(config, "mlp_layer_types")
    if types is None:
        types = ["dense"] + ["sparse"] * (layers - 1)
    if len(types) != layers:
        raise ValueError(f"mlp_layer_types has {len(types)} entries for {layers} layers")
    return list(types)


# ------------------------------------------------------------------------------ the on-disk cache

# Deriving an architecture imports torch and transformers and builds the model on the meta device: about
# 5 s of every Snakemake start, `mixquant paths` and SLURM job on two cores, for a result that only the
# config.json, the two packages and this package's code decide. A workflow keeps it in its working
# directory (common.smk and the CLI point this at WORKDIR_CACHE); None: no cache.
WORKDIR_CACHE = Path(".snakemake") / "mixquant-architectures"
# One cache for several working directories (a user's, on one filesystem): each entry's name hashes the
# config.json with the package versions and this code, so directories never read each other's stale entry.
CACHE_ENV = "MIXQUANT_ARCHITECTURE_CACHE"
_cache_dir: Path | None = None


def workflow_cache() -> Path:
    """Where a workflow keeps derived architectures: $MIXQUANT_ARCHITECTURE_CACHE if set, else its
    .snakemake/mixquant-architectures."""
    return Path(os.environ[CACHE_ENV]) if os.environ.get(CACHE_ENV) else WORKDIR_CACHE


def cache_architectures(directory: str | Path | None) -> None:
    """Keep derived architectures as JSON files in ``directory`` (None: derive every time)."""
    global _cache_dir
    _cache_dir = Path(directory).absolute() if directory is not None else None
    _cached_architecture.cache_clear()


@lru_cache(maxsize=1)
def _derivation_identity() -> str:
    """What besides config.json decides an architecture: transformers, torch and this package's code."""
    from importlib import metadata

    digest = hashlib.sha256()
    for package in ("transformers", "torch"):
        digest.update(f"{package}=={metadata.version(package)}\n".encode())
    for source in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    return digest.hexdigest()


def _from_json(data: dict[str, Any]) -> Architecture:
    rewrite = data["vllm_key_rewrite"]
    return Architecture(
        model_type=str(data["model_type"]),
        family=str(data["family"]),
        moe_layers=tuple(int(i) for i in data["moe_layers"]),
        num_experts=int(data["num_experts"]),
        experts_per_token=int(data["experts_per_token"]),
        num_hidden_layers=int(data["num_hidden_layers"]),
        dtype=str(data["dtype"]),
        tensors={str(n): (tuple(int(d) for d in dims), str(dt)) for n, (dims, dt) in data["tensors"].items()},
        expert_templates={str(k): str(v) for k, v in data["expert_templates"].items()},
        experts_module_template=str(data["experts_module_template"]),
        source_formats=tuple(str(f) for f in data["source_formats"]),
        kv_cache_scales=bool(data["kv_cache_scales"]),
        vllm_key_rewrite=None if rewrite is None else (str(rewrite[0]), str(rewrite[1])),
    )


@lru_cache(maxsize=8)
def _cached_architecture(config_json: str) -> Architecture:
    if _cache_dir is None:
        return _architecture(config_json)
    key = hashlib.sha256(f"{_derivation_identity()}\n{config_json}".encode()).hexdigest()
    path = _cache_dir / f"{key}.json"
    try:
        entry = read_json(path, "architecture cache")
        if entry.get("config") == config_json:
            return _from_json(entry["architecture"])
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        pass  # absent, being replaced or damaged: derive it again
    arch = _architecture(config_json)
    try:
        write_json_atomic(path, {"config": config_json, "architecture": dataclasses.asdict(arch)})
    except OSError:
        pass  # a cache: a read-only or full disk only costs the next start its 5 s
    return arch


# Upper bounds of a config.json's sizes, far beyond any published model (DeepSeek-V3: 61 layers, 7168
# hidden, 256 experts; Qwen3: 151,936 tokens): a config beyond them is refused before transformers
# builds anything from it.
SIZE_LIMITS = {
    "num_hidden_layers": 1024,
    "hidden_size": 1 << 16,
    "intermediate_size": 1 << 18,
    "moe_intermediate_size": 1 << 18,
    "shared_expert_intermediate_size": 1 << 18,
    "vocab_size": 1 << 23,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "head_dim": 4096,
    "num_experts": 1 << 14,
    "n_routed_experts": 1 << 14,
    "num_local_experts": 1 << 14,
    "num_experts_per_tok": 1 << 10,
    "n_shared_experts": 64,
    "q_lora_rank": 1 << 16,
    "kv_lora_rank": 1 << 16,
    "max_position_embeddings": 1 << 24,
}


def check_sizes(config: Mapping[str, Any]) -> None:
    """One line naming the first size of ``config`` that is not a whole number within SIZE_LIMITS."""
    for key, limit in SIZE_LIMITS.items():
        value = config.get(key)
        if value is None:
            continue
        if type(value) is not int or not 0 < value <= limit:
            raise UnsupportedArchitecture(
                f"config.json {key}: {str(value)[:40]!r} is not a whole number in 1..{limit}"
            )
