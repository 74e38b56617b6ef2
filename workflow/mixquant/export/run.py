"""Stage entry point for export_checkpoint (rule script and the CLI call it)."""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Any

from mixquant import faults
from mixquant.export.files import AUDIT_FILE, CONFIG_FILE, GENERATION_CONFIG_FILE, TOKENIZER_FILES
from mixquant.export.inspect import inspect_checkpoint
from mixquant.export.predict import predict_structure
from mixquant.keys.manifest import publish_keyed_dir
from mixquant.model.fetch import resolve_model_dir
from mixquant.quantize.run import layer_result_dir

__all__ = ["AUDIT_FILE", "checkpoint_audit", "run_export_checkpoint", "tokenizer_source_dir"]

log = logging.getLogger(__name__)


def checkpoint_audit(
    export_dir: Path,
    placement: dict[int, str],
    kv_cache: str | None,
    producer: dict,
    source_dir: Path | None = None,
) -> dict:
    """The audit shipped with the export: what the files hold, what config.json predicts, and whether
    the two agree (tensor counts, payload bytes, effective routed bits, per-layer formats). With
    ``source_dir`` the prediction takes the non-expert tensors' dtypes from the source's shard headers
    (the export copies them as published)."""
    from mixquant.checkpoint.shards import ShardReader  # lazy: imports torch

    # The audit describes the directory it ships in: not the temporary path it was written under (a pid
    # and a random suffix would make the file differ between two runs of the same key).
    inspection = {**inspect_checkpoint(export_dir), "directory": "."}
    config = json.loads((export_dir / CONFIG_FILE).read_text("utf-8"))
    source_dtypes = None
    if source_dir is not None:
        reader = ShardReader(source_dir)
        source_dtypes = {name: reader.spec(name)["dtype"] for name in reader.names}
    predicted = predict_structure(
        config, placement=placement, kv_cache_quant="FP8" if kv_cache else None, source_dtypes=source_dtypes
    )
    agreement = {
        "tensors": inspection["tensors"]["total"] == predicted["tensors"]["total"],
        "payload_bytes": inspection["payload_bytes"] == predicted["payload_bytes"],
        "routed_effective_bits": inspection["routed_effective_bits"] == predicted["routed_effective_bits"],
        "layer_formats": inspection["layer_formats"] == predicted["layer_formats"],
    }
    return {
        "producer": producer,
        "inspection": inspection,
        "predicted": predicted,
        "agreement": agreement,
    }


def tokenizer_source_dir(tokenizer: dict[str, Any], model_dir: Path, scratch: Path) -> Path:
    """Where the export copies tokenizer files from: the model, or a pinned hub revision (the
    reference release takes its tokenizer from another BF16 revision than its weights)."""
    if tokenizer["source"] == "model":
        return model_dir
    if tokenizer.get("revision") is None:
        raise ValueError(f"tokenizer {tokenizer['repo']}: refusing an unpinned revision")
    from huggingface_hub import snapshot_download

    return Path(
        snapshot_download(
            tokenizer["repo"],
            revision=tokenizer["revision"],
            allow_patterns=list(TOKENIZER_FILES) + [GENERATION_CONFIG_FILE],
            local_dir=scratch,
        )
    )


def run_export_checkpoint(
    out_dir: str | Path,
    *,
    model: str | Path,
    activations: str | Path | None = None,
    settings: dict[str, Any],
    preimage: dict[str, Any],
    **layers: str | Path,
) -> Path:
    """Assemble, shard and audit the ModelOpt MIXED_PRECISION checkpoint (`layers`: layer_L -> the
    quantize_layer window holding layer L in its placed format)."""
    from mixquant.export.checkpoint import export_checkpoint  # lazy: imports torch

    placement = {int(layer): fmt for layer, fmt in settings["placement"].items()}
    layer_dirs = {
        layer: (fmt, layer_result_dir(layers[f"layer_{layer}"], layer)) for layer, fmt in placement.items()
    }
    export = settings["export"]
    kv_amax = None
    if export["kv_cache_quant"]:
        from mixquant.quantize.activations import load_activation_stats  # lazy: imports torch

        kv_amax = load_activation_stats(Path(activations))
    model_dir = resolve_model_dir(model)
    summary: dict[str, Any] = {}
    with publish_keyed_dir(out_dir, preimage, summary) as tmp, tempfile.TemporaryDirectory() as scratch:
        tokenizer_dir = tokenizer_source_dir(settings["tokenizer"], model_dir, Path(scratch))
        result = export_checkpoint(
            model_dir,
            layer_dirs,
            tmp,
            tokenizer_dir=tokenizer_dir,
            num_shards=export["num_shards"],
            max_shard_bytes=export["max_shard_bytes"],
            kv_cache=export["kv_cache_quant"],
            kv_amax=kv_amax,
            producer=settings["producer"],
        )
        faults.point("shards-written", "export_checkpoint")  # the checkpoint written, not yet audited
        audit = checkpoint_audit(tmp, placement, export["kv_cache_quant"], settings["producer"], model_dir)
        if not all(audit["agreement"].values()):
            raise RuntimeError(f"checkpoint audit disagrees with the prediction: {audit['agreement']}")
        (tmp / AUDIT_FILE).write_text(
            json.dumps(audit, indent=2, sort_keys=True, default=str) + "\n", "utf-8"
        )
        summary.update(export=result, agreement=audit["agreement"])
    log.info("exported %s", out_dir)
    return Path(out_dir)
