"""Cost functions of the source stages: the model (fetched, dequantized or the toy built), the calibration
tokens and the pinned prompt."""

from __future__ import annotations

from mixquant.costs.job import CostJob
from mixquant.costs.sizes import dataset_split_bytes, fp8_source_bytes
from mixquant.facts import source_fp8_block
from mixquant.facts.jobs import batch_activation_bytes


def fetch_model(job: CostJob) -> None:
    cfg, geometry = job.cfg, job.geometry
    source_bytes = fp8_source_bytes(geometry) if source_fp8_block(cfg) else job.model_bytes
    if cfg.model.source == "hub":
        job.download, job.written, job.hashed = source_bytes, source_bytes, source_bytes
        job.read = source_bytes  # local_dir_identity hashes every downloaded file
    else:
        job.read = job.hashed = job.model_bytes  # fetch_local_model hashes the directory in place
        job.notes.append("local: nothing copied, every file hashed")


def dequantize_source(job: CostJob) -> None:
    """Block FP8 -> BF16 a shard at a time (checkpoint.fp8_source)."""
    geometry, hw = job.geometry, job.hw
    job.read = job.hashed = fp8_source_bytes(geometry)
    job.written = job.model_bytes
    job.compute_s = geometry.total_params / (hw.cpu_dequant_fp8_elements_per_s_per_core * job.cpus)
    job.host += 3 * job.model_bytes // max(1, geometry.num_hidden_layers)  # about one shard in and out


def build_toy_model(job: CostJob) -> None:
    cfg, geometry, hw = job.cfg, job.geometry, job.hw
    job.cpus = cfg.model.toy.threads  # the toy trains with its own threads
    toy = cfg.model.toy
    tokens = toy.training.steps * toy.training.batch_size * toy.training.seq_len
    evaluated = 2 * toy.training.eval_sequences * toy.training.seq_len
    job.compute_s = max(
        (
            3 * geometry.forward_flops(toy.training.seq_len, 1) * tokens / toy.training.seq_len
            + geometry.forward_flops(toy.training.seq_len, 1) * evaluated / toy.training.seq_len
        )
        / job.cpu_flops,
        toy.training.steps * hw.toy_step_s,
    )
    job.read = dataset_split_bytes(cfg, hw)
    job.written = job.model_bytes
    job.host += (
        geometry.total_params * 16
        + batch_activation_bytes(geometry, toy.training.batch_size, toy.training.seq_len) * 4
    )


def _dataset_stage(job: CostJob, splits: int, tokens: int) -> None:
    """A stage that loads ``splits`` dataset splits and tokenizes ``tokens`` tokens."""
    cfg, hw = job.cfg, job.hw
    data = splits * dataset_split_bytes(cfg, hw)
    if cfg.dataset.source == "hub":
        job.download = data
        job.scratch = data  # the Arrow cache of the downloaded splits (a temporary directory)
    job.read = data
    if cfg.dataset.source == "hub" and data:  # memory-mapped Arrow, rows decoded as they are sampled
        job.host += hw.arrow_conversion_bytes
    else:  # the local JSONL is materialised as Python lists and dicts
        job.host += int(data * hw.python_object_factor)
    job.compute_s = tokens / hw.tokenize_tokens_per_s


def sample_calibration(job: CostJob) -> None:
    cfg, calib = job.cfg, job.cfg.calibration
    splits = sum(len(m.splits) for m in cfg.dataset.hub) if cfg.dataset.source == "hub" else 1
    job.written = calib.num_samples * calib.seq_len * 4
    _dataset_stage(job, splits, calib.num_samples * calib.seq_len)


def pin_prompt(job: CostJob) -> None:
    splits = 0 if job.cfg.prompt.source == "token_ids_file" else 1
    job.written = job.prompt_len * 4
    _dataset_stage(job, splits, job.prompt_len)
