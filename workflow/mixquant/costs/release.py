"""Cost functions of the release stages: the hash check and the bundle."""

from __future__ import annotations

from mixquant.costs.hardware import MIB
from mixquant.costs.job import CostJob
from mixquant.costs.sizes import placement_counts
from mixquant.export.predict import checkpoint_tensors, predict_structure


def verify_hashes(job: CostJob) -> None:
    """The prompt, the reference logits (loaded, then hashed from a numpy copy) and the checkpoint's
    hf_quant_config.json and index (~100 B of JSON per tensor)."""
    entries = checkpoint_tensors(job.geometry.to_hf_config(), {}, kv_cache_quant=None)
    job.read = job.prompt_len * 4 + job.logits_bytes + 100 * len(entries)
    job.hashed = job.logits_bytes + 100 * len(entries)
    job.host += 2 * job.logits_bytes
    job.written = 5_000


def assemble_release(job: CostJob) -> None:
    """The checkpoint is hardlinked (no bytes copied) but the release's manifest hashes every file of it;
    release_hashes re-hashes the reference logits; card, recipe, audits and aggregates are small."""
    cfg, geometry = job.cfg, job.geometry
    counts = placement_counts(cfg, geometry)
    kv = "FP8" if cfg.export.kv_cache_quant else None
    structure = predict_structure(geometry.to_hf_config(), placement_counts=counts, kv_cache_quant=kv)
    entries = checkpoint_tensors(geometry.to_hf_config(), {}, kv_cache_quant=kv)
    checkpoint = structure["payload_bytes"] + 200 * len(entries)
    job.read = checkpoint + job.logits_bytes + job.prompt_len * 4
    job.hashed = checkpoint + job.logits_bytes
    job.host += 2 * job.logits_bytes + 512 * MIB
    job.written = 200_000
