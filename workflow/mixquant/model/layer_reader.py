"""The routed-expert weights of one MoE layer, read straight from an upstream checkpoint's shards.

:class:`LayerSource` opens only the shards that hold one layer's experts and reads one tensor at a time
(``safe_open``), after checking everything that can be checked without reading tensor data (the index,
the expected names, every needed shard's header and size, dtypes and shapes): the per-layer rebuild reads
one expert at a time from it, never the whole model. The expert names are the family's
(:mod:`mixquant.model.families`), or the qwen2_moe-style default where config.json names no model_type.
A bad checkpoint is one line naming the culprit (:class:`mixquant.checkpoint.shards.CheckpointError`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from mixquant.checkpoint.shards import INDEX_FILE, SINGLE_FILE, CheckpointError, read_safetensors_header
from mixquant.jsonio import read_json
from mixquant.model.families import (
    DEFAULT_EXPERT_TEMPLATES,
    DEFAULT_EXPERT_WEIGHT,
    PROJECTIONS,
    UnsupportedArchitecture,
    architecture,
    mlp_layer_types,
)
from mixquant.model.layout import CONFIG_FILE

__all__ = ["LayerSource", "check_checkpoint_shards", "read_layer_experts"]


def check_checkpoint_shards(model_dir: Path) -> int:
    """Validate every safetensors shard's header and size before a whole-model load.

    Whole-model readers (the activation-statistics forward) call this first so that a truncated or
    corrupt shard stops them with one line naming the file, as it stops quantize_layer.
    Returns the number of shards checked.
    """
    shards = sorted(Path(model_dir).glob("*.safetensors"))
    for shard in shards:
        read_safetensors_header(shard)
    return len(shards)


def _load_json(path: Path, what: str) -> Any:
    return read_json(path, what, error=CheckpointError)


class LayerSource:
    """The routed-expert tensors of one layer in an upstream checkpoint: index, headers, lazy reads.

    Construction checks everything that can be checked without reading tensor data: the index (or the
    single ``model.safetensors``), the expected tensor names (``num_experts`` from config.json, else the
    expert ids in the index, which must be 0..E-1 with all three projections), every needed shard's header
    and size, dtype bfloat16 and consistent ``[I, H]`` / ``[H, I]`` shapes. :meth:`get` reads one tensor
    and checks it is finite.
    """

    def __init__(self, model_dir: Path, layer: int):
        self.model_dir = Path(model_dir)
        self.layer = int(layer)
        if not self.model_dir.is_dir():
            raise CheckpointError(f"{self.model_dir}: checkpoint directory does not exist")
        weight_map, where = self._weight_map()
        self.templates, self.num_experts = self._layout(weight_map, where)
        names = [self.name(e, p) for e in range(self.num_experts) for p in PROJECTIONS]
        missing = [n for n in names if n not in weight_map]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise CheckpointError(f"layer {self.layer}: tensor {missing[0]} is missing from {where}{more}")
        self.files = {name: self.model_dir / weight_map[name] for name in names}
        headers = {path: read_safetensors_header(path) for path in sorted(set(self.files.values()))}
        self.specs: dict[str, tuple[str, tuple[int, ...]]] = {}
        for name, path in self.files.items():
            info = headers[path].get(name)
            if info is None:
                raise CheckpointError(
                    f"layer {self.layer}: tensor {name} is not in {path} (listed in {where})"
                )
            self.specs[name] = (info["dtype"], tuple(int(d) for d in info["shape"]))
        self._check_specs()
        self._handles: dict[Path, Any] = {}
        self._stack = contextlib.ExitStack()

    def _weight_map(self) -> tuple[dict[str, str], Path]:
        index = self.model_dir / INDEX_FILE
        if index.exists():
            data = _load_json(index, "safetensors index")
            weight_map = data.get("weight_map") if isinstance(data, dict) else None
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: corrupt safetensors index (no weight_map)")
            return {str(k): str(v) for k, v in weight_map.items()}, index
        single = self.model_dir / SINGLE_FILE
        if single.exists():
            return dict.fromkeys(read_safetensors_header(single), SINGLE_FILE), single
        raise CheckpointError(f"{self.model_dir}: neither {INDEX_FILE} nor {SINGLE_FILE} found")

    def name(self, expert: int, proj: str) -> str:
        """The disk name of expert ``expert``'s ``proj`` weight in this checkpoint."""
        return self.templates[proj].format(layer=self.layer, expert=int(expert))

    def prefix(self, expert: int, proj: str) -> str:
        return self.name(expert, proj).removesuffix(".weight")

    def _layout(self, weight_map: Mapping[str, str], where: Path) -> tuple[dict[str, str], int]:
        """(expert name templates, expert count): the family's, from a config.json naming its model_type;
        else the qwen2_moe-style names and the count from config.json or the index."""
        config_path = self.model_dir / CONFIG_FILE
        config = _load_json(config_path, "model config") if config_path.exists() else None
        if isinstance(config, dict) and isinstance(config.get("model_type"), str):
            try:
                arch = architecture(config)
            except UnsupportedArchitecture as exc:
                raise CheckpointError(f"{config_path}: {exc}") from exc
            if not 0 <= self.layer < arch.num_hidden_layers:
                raise CheckpointError(
                    f"layer {self.layer}: out of range, {config_path} has {arch.num_hidden_layers} layers"
                )
            if not arch.is_moe_layer(self.layer):
                raise CheckpointError(
                    f"layer {self.layer}: is a dense layer (no routed experts) per {config_path}"
                )
            return dict(arch.expert_templates), arch.num_experts
        return dict(DEFAULT_EXPERT_TEMPLATES), self._num_experts(config, weight_map, where)

    def _num_experts(self, config: Any, weight_map: Mapping[str, str], where: Path) -> int:
        config_path = self.model_dir / CONFIG_FILE
        if config is not None:
            if isinstance(config, dict) and config.get("num_experts") is not None:
                if config.get("num_hidden_layers") is not None:
                    layers = int(config["num_hidden_layers"])
                    if not 0 <= self.layer < layers:
                        raise CheckpointError(
                            f"layer {self.layer}: out of range, {config_path} has {layers} layers"
                        )
                    try:
                        mlp_type = mlp_layer_types(config)[self.layer]
                    except ValueError as exc:
                        raise CheckpointError(f"{config_path}: {exc}") from exc
                    if mlp_type != "sparse":
                        raise CheckpointError(
                            f"layer {self.layer}: is a {mlp_type} layer (no routed experts) per {config_path}"
                        )
                return int(config["num_experts"])
        ids = set()
        for name in weight_map:
            match = DEFAULT_EXPERT_WEIGHT.match(name)
            if match and int(match.group(1)) == self.layer:
                ids.add(int(match.group(2)))
        if not ids:
            raise CheckpointError(f"layer {self.layer}: no routed-expert tensors in {where}")
        return max(ids) + 1

    def _check_specs(self) -> None:
        shapes: dict[str, tuple[int, ...]] = {}
        proj_of = {self.name(e, p): p for e in range(self.num_experts) for p in PROJECTIONS}
        for name, (dtype, shape) in self.specs.items():
            proj = proj_of[name]
            if dtype != "BF16":
                raise CheckpointError(
                    f"layer {self.layer}: tensor {name} has dtype {dtype} in {self.files[name]}, "
                    "expected BF16"
                )
            if len(shape) != 2:
                raise CheckpointError(f"layer {self.layer}: tensor {name} has shape {list(shape)}, not 2-D")
            want = shapes.setdefault(proj, shape)
            if shape != want:
                raise CheckpointError(
                    f"layer {self.layer}: tensor {name} has shape {list(shape)}, other experts' {proj} "
                    f"{list(want)}"
                )
        gate, up, down = (shapes[p] for p in PROJECTIONS)
        if up != gate or down != gate[::-1]:
            raise CheckpointError(
                f"layer {self.layer}: inconsistent expert shapes gate {list(gate)}, up {list(up)}, "
                f"down {list(down)} (expected [I, H], [I, H], [H, I])"
            )
        self.shapes = shapes

    def __enter__(self) -> LayerSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()

    def get(self, name: str) -> torch.Tensor:
        """Read one tensor (bf16) from its shard; finite check."""
        path = self.files[name]
        try:
            handle = self._handles.get(path)
            if handle is None:
                handle = self._stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
                self._handles[path] = handle
            tensor = handle.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
            detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise CheckpointError(f"{path}: cannot read {name} (corrupt shard: {detail})") from exc
        if tensor.dtype != torch.bfloat16 or tuple(tensor.shape) != self.specs[name][1]:
            raise CheckpointError(f"{path}: {name} reads back as {tensor.dtype} {list(tensor.shape)}")
        if not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            kind = "NaN" if bool(torch.isnan(tensor).any()) else "Inf"
            raise CheckpointError(
                f"layer {self.layer}: tensor {name} has {bad} non-finite value(s) ({kind}) in {path}"
            )
        return tensor

    def experts(self) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """``(expert, {proj: bf16 weight})`` one expert at a time."""
        for e in range(self.num_experts):
            yield e, {p: self.get(self.name(e, p)) for p in PROJECTIONS}


def read_layer_experts(model_dir: Path, layer: int) -> dict[str, torch.Tensor]:
    """All routed-expert weights of ``layer`` (upstream names, bf16), read from the shards that hold them.

    Only the needed shards are opened, and only these tensors are read (``safe_open``). Raises
    :class:`CheckpointError` for a missing tensor, a non-bf16 or misshapen one, NaN/Inf values, or a
    truncated / corrupt shard (file size is checked against the header's declared data first).
    """
    with LayerSource(model_dir, layer) as source:
        return {name: source.get(name) for name in source.files}
