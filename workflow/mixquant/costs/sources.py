"""Cost functions of the source stages: the model (fetched, dequantized or the toy built), the calibration
tokens, the pinned prompt and the evaluation suite's windows."""

from __future__ import annotations

from pathlib import Path

from mixquant.config.kld import EvalDomain
from mixquant.costs.hardware import Hardware
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


# sample_eval's draw and check
# assumption: a document is tokenized whole before its first T tokens are kept, and the documents shorter
# than T are tokenized and skipped: four document tokens per window token
DRAWN_TOKENS_PER_WINDOW_TOKEN = 4
# assumption: the disjointness check's set of unit SHA-256 hex digests (~200 B a set entry) per byte of
# text, at a unit (a message, a document) of ~1 kB
UNIT_SET_BYTES_PER_TEXT_BYTE = 0.2
EVAL_JSON_BYTES_PER_WINDOW = 200  # eval.json: a window's domain, document index and document SHA-256


def _domain_bytes(domain: EvalDomain, hw: Hardware) -> int:
    """Bytes of one domain's documents as loaded: a local JSONL's size when it is there (relative to the
    working directory), else the assumed hub split size."""
    if domain.local is not None and Path(domain.local.path).is_file():
        return Path(domain.local.path).stat().st_size
    return hw.hub_dataset_split_bytes


def sample_eval(job: CostJob) -> None:
    """The suite's windows drawn, after every document of every domain and every row of the calibration
    dataset was checked for shared content (mixquant.calibration.eval_suite): each domain's rows are held
    as Python objects (a hub split downloaded whole), the calibration dataset as sample_calibration reads
    it (hub: memory-mapped, rows decoded as visited), every content unit hashed into one set."""
    cfg, hw, suite = job.cfg, job.hw, job.cfg.kld.eval
    if suite is None:
        raise ValueError("sample_eval: needs kld.eval")
    domains = [_domain_bytes(domain, hw) for domain in suite.domains]
    hub = sum(size for size, domain in zip(domains, suite.domains, strict=True) if domain.hub is not None)
    splits = sum(len(m.splits) for m in cfg.dataset.hub) if cfg.dataset.source == "hub" else 1
    calibration = splits * dataset_split_bytes(cfg, hw)
    job.download = hub + (calibration if cfg.dataset.source == "hub" else 0)
    job.scratch = job.download  # the Arrow cache of the downloaded splits (a temporary directory)
    text = sum(domains) + calibration
    job.read = text
    job.hashed = text  # every content unit's SHA-256
    job.host += int(sum(domains) * hw.python_object_factor)
    if cfg.dataset.source == "hub":
        job.host += hw.arrow_conversion_bytes
    else:
        job.host += int(calibration * hw.python_object_factor)
    job.host += int(text * UNIT_SET_BYTES_PER_TEXT_BYTE)
    drawn = DRAWN_TOKENS_PER_WINDOW_TOKEN * job.suite_tokens
    job.compute_s = drawn / hw.tokenize_tokens_per_s + text / hw.python_text_bytes_per_s
    job.written = job.suite_tokens * 4 + job.suite_windows * EVAL_JSON_BYTES_PER_WINDOW + 10_000
