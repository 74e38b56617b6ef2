"""Cost functions of the KLD stages: reference logits, the candidate's runs, the gates, the report and the
verdict.

What an engine pass scores (:mod:`mixquant.kld.capture`): the pinned prompt -- one window of
``prompt.seq_len`` tokens, its reference the full float32 logits -- and, with ``kld.eval``, the evaluation
suite: W windows of T tokens, its reference stored full or in the top-k form. A pass is one fresh engine (a
fresh process with vLLM) over its windows, one forward per window: it records the reference (the first
capture) or scores the engine's logits against the stored one, a window at a time. ``reference_logits``
is one job per reference: the prompt's (one pass), the suite's (``reference_captures`` passes, the further
ones scored against the first: the noise floor). A ``run_kld`` job does ``kld.runs`` passes, each over the
prompt and the suite.
"""

from __future__ import annotations

from dataclasses import dataclass

from mixquant.costs.hardware import GIB, MIB
from mixquant.costs.job import CostJob
from mixquant.costs.sizes import candidate_bytes, pinned_layer_bytes, streamed_seconds
from mixquant.facts.jobs import batch_activation_bytes, max_layer_bytes, non_layer_bytes

# per_position.safetensors: kl, p_ref, p_cand, ref_nll, cand_nll float64 and top1_same uint8; scored against
# the top-k form, kl_low and kl_high (float64) besides
PER_POSITION_BYTES = 5 * 8 + 1
TOPK_BOUND_BYTES = 2 * 8
RUN_JSON_BYTES = 10_000  # kld.json / reference.json: summary, engine info, numerics fingerprint
BOOTSTRAP_FLOPS_PER_DRAW = 10  # one resampled index and its share of the resampled mean
PLOTS_PER_KV = 2  # per KV dtype: the KL CDF and the per-position KL; the suite adds the CDF per domain
# A suite's reference stored full at more than this share of the BF16 model's size, and more than this many
# bytes (a toy's exact reference is small whatever its share): a plan warns and names the top-k form
FULL_REFERENCE_WARNING_SHARE = 0.1
FULL_REFERENCE_WARNING_BYTES = 10 * 10**9


def topk_reference_bytes(positions: int, top_k: int) -> int:
    """:func:`mixquant.kld.topk.reference_bytes` without torch (planning imports none): per position the
    ``top_k`` int32 ids and float32 log-probabilities and four float64 scalars (log-normalisation, tail mass,
    its entropy term, the next token's log-probability). tests/test_costs.py holds the two equal."""
    return int(positions) * (int(top_k) * (4 + 4) + 4 * 8)


def full_reference_bytes(positions: int, vocab: int) -> int:
    """Full-vocabulary float32 reference logits ``[positions, V]`` (as
    :func:`mixquant.kld.topk.full_reference_bytes`)."""
    return int(positions) * int(vocab) * 4


@dataclass(frozen=True)
class WindowSet:
    """What a pass scores of one protocol: ``windows`` windows of ``tokens`` tokens, each scoring
    ``tokens - 1`` positions, and the form its reference is stored in."""

    windows: int
    tokens: int
    form: str = "full"
    top_k: int | None = None

    @property
    def positions(self) -> int:
        return self.windows * (self.tokens - 1)

    def reference_bytes(self, vocab: int) -> int:
        if self.form == "topk":
            return topk_reference_bytes(self.positions, int(self.top_k or 0))
        return full_reference_bytes(self.positions, vocab)

    @property
    def per_position_bytes(self) -> int:
        return PER_POSITION_BYTES + (TOPK_BOUND_BYTES if self.form == "topk" else 0)


def prompt_windows(job: CostJob) -> WindowSet:
    return WindowSet(1, job.prompt_len)


def suite_windows(job: CostJob) -> WindowSet | None:
    """The evaluation suite's windows (None without ``kld.eval``)."""
    suite = job.cfg.kld.eval
    if suite is None:
        return None
    return WindowSet(job.suite_windows, suite.window_tokens, suite.reference, suite.top_k)


@dataclass
class _Pass:
    """One fresh engine's pass: bytes, seconds and its peak memory."""

    read: float = 0
    written: float = 0
    hashed: float = 0
    compute_s: float = 0.0
    streamed_s: float = 0.0
    streamed_read: float = 0
    host: float = 0
    gpu_bytes: float = 0


def _engine_pass(job: CostJob, checkpoint: int, sets: list[WindowSet], record: bool) -> _Pass:
    """One fresh engine over ``sets``: a forward per window; the reference recorded (``record``: kept
    whole, then written) or read a window at a time and scored, the per-position statistics written. Every
    window's float32 logits are hashed (the reference's canonical SHA-256, the candidate's)."""
    cfg, geometry, hw = job.cfg, job.geometry, job.hw
    vocab = geometry.vocab_size
    done = _Pass()
    done.read = checkpoint + sum(s.windows * s.tokens * 4 for s in sets)
    done.hashed = sum(full_reference_bytes(s.positions, vocab) for s in sets)
    positions = sum(s.positions for s in sets)
    # a window at a time where the engine leaves its logits (hf: the CPU; vLLM under CUDA: its first GPU,
    # memory-bound there, ~10 float32 passes over [T-1, V], ~20 with the top-k form): the KL statistics of a
    # scored window, the top-k reduction of a recorded one (a full reference is stored as it comes)
    on_gpu = cfg.kld.engine == "vllm" and job.gpus > 0
    for s in sets:
        topk = s.form == "topk"
        if record and not topk:
            continue
        if on_gpu:
            done.compute_s += s.positions * vocab * 4 * (20 if topk else 10) / hw.gpu_memory_bytes_per_s
        elif not record:
            rate = hw.cpu_topk_kl_logits_per_s_per_core if topk else hw.cpu_kl_logits_per_s_per_core
            done.compute_s += s.positions * vocab / rate
        else:
            done.compute_s += s.positions * vocab / hw.cpu_topk_reduce_logits_per_s_per_core
    if record:
        done.written = sum(s.reference_bytes(vocab) for s in sets)  # and reference.json, a few kB
    else:
        done.read += sum(s.reference_bytes(vocab) for s in sets)
        done.written = sum(s.positions * s.per_position_bytes + RUN_JSON_BYTES for s in sets)
    host = 0
    for s in sets:
        window_logits = full_reference_bytes(s.tokens - 1, vocab)
        # the engine's output: fp32 result, its bf16 rounding and fp32 copy, the bytes hashed
        transient = 3 * window_logits
        if record:  # the windows' references kept, then concatenated into the file
            stored, window_stored = s.reference_bytes(vocab), WindowSet(1, s.tokens, s.form, s.top_k)
            window_stored_bytes = window_stored.reference_bytes(vocab)
            host = max(host, transient + stored - window_stored_bytes, 2 * stored)
        else:  # the window's reference rows, the per-position parts and their concatenation
            window_reference = WindowSet(1, s.tokens, s.form, s.top_k).reference_bytes(vocab)
            host = max(host, transient + window_reference + 2 * s.positions * s.per_position_bytes)
    tokens = max(s.tokens for s in sets)
    flops = sum(s.windows * geometry.forward_flops(s.tokens) for s in sets)
    if cfg.kld.engine == "vllm":
        tp = cfg.kld.tensor_parallel_size
        if job.gpus < tp:
            raise ValueError(
                f"{job.stage}: vllm with tensor_parallel_size {tp} needs {tp} GPUs, job has {job.gpus}"
            )
        # lm_head applied off-engine in fp32 on the engine's first GPU (mixquant.kld.vllm_engine)
        done.compute_s += 2 * positions * geometry.lm_head_params / hw.gpu_fp32_flops
        done.compute_s += flops / (tp * hw.gpu_bf16_flops * hw.gpu_mfu)
        done.gpu_bytes = int(hw.vllm_gpu_memory_utilization * hw.gpu_memory_bytes)
        host += tp * hw.vllm_worker_host_bytes + geometry.lm_head_params * 6  # bf16 + fp32 lm_head
        if checkpoint / tp > done.gpu_bytes:
            note = f"weights {checkpoint / tp / GIB:.0f} GiB per GPU exceed vLLM's reservation"
            job.notes += [note] if note not in job.notes else []
    else:  # hf: layer-streamed on numerics.device, each layer read once per task for all its windows
        windows = sum(s.windows for s in sets)
        act = batch_activation_bytes(geometry, 1, tokens) + tokens * vocab * 2
        held = 2 * max_layer_bytes(geometry) + non_layer_bytes(geometry) + act
        held += windows * tokens * geometry.hidden_size * 2  # every window's hidden states, bf16
        for s in sets:
            done.streamed_s += streamed_seconds(
                checkpoint,
                s.windows * geometry.forward_flops(s.tokens) / job.device_flops,
                geometry,
                hw,
                job.on_gpu,
            )
        done.read += (len(sets) - 1) * checkpoint
        done.streamed_read = len(sets) * checkpoint
        if job.on_gpu:
            done.gpu_bytes = held
            host += 2 * pinned_layer_bytes(geometry)
        else:
            host += held
        host += tokens * vocab * 2  # logits [1, T, V] bf16
    done.host = host
    return done


def _apply(job: CostJob, passes: list[_Pass], scratch: float = 0) -> None:
    """The job's totals over its passes (each a fresh engine: vllm a fresh process and engine start each);
    the peak is the largest pass's."""
    if job.cfg.kld.engine == "vllm":
        job.startup += job.hw.vllm_startup_s
        job.startup += (len(passes) - 1) * job.startup  # a further pass's own process and engine
    job.read = sum(p.read for p in passes)
    job.written = sum(p.written for p in passes) - scratch
    job.scratch = scratch
    job.hashed = sum(p.hashed for p in passes)
    job.compute_s = sum(p.compute_s for p in passes)
    job.streamed_s = sum(p.streamed_s for p in passes)
    job.streamed_read = sum(p.streamed_read for p in passes)
    job.host += max(p.host for p in passes)
    job.gpu_bytes = max(p.gpu_bytes for p in passes)


def reference_logits(job: CostJob) -> None:
    """The prompt's reference (one pass), or the suite's (``job.suite``): ``reference_captures`` passes,
    the first recording the reference, the others scoring against it into scratch (the noise floor)."""
    if not job.suite:
        _apply(job, [_engine_pass(job, job.model_bytes, [prompt_windows(job)], record=True)])
        return
    windows = suite_windows(job)
    if windows is None:
        raise ValueError("reference_logits: the suite's reference needs kld.eval")
    suite = job.cfg.kld.eval
    passes = [_engine_pass(job, job.model_bytes, [windows], record=True)]
    again = _engine_pass(job, job.model_bytes, [windows], record=False)
    passes += [again] * (suite.reference_captures - 1)
    scratch = sum(p.written for p in passes[1:])  # a further capture's statistics, removed once compared
    _apply(job, passes, scratch)
    vocab = job.geometry.vocab_size
    stored = windows.reference_bytes(vocab)
    job.notes.append(
        f"suite: {windows.windows} windows x {windows.tokens} tokens, {windows.positions} positions, "
        f"reference {windows.form} {stored / 1e9:.2f} GB, {suite.reference_captures} captures"
    )
    full = full_reference_bytes(windows.positions, vocab)
    large = full > FULL_REFERENCE_WARNING_BYTES and full > FULL_REFERENCE_WARNING_SHARE * job.model_bytes
    if windows.form == "full" and large:
        topk = topk_reference_bytes(windows.positions, suite.top_k)
        runs = job.cfg.kld.runs * len(job.cfg.kld.candidates) * len(job.cfg.kld.kv_cache_dtypes)
        job.warnings.append(
            f"kld.eval.reference: full stores the suite's reference as {full / 1e9:.0f} GB of float32 logits "
            f"({windows.positions} positions x {vocab} x 4 B, {full / job.model_bytes:.0%} of the BF16 "
            f"model), read again by each of up to {runs} KLD runs; reference: topk (top_k {suite.top_k}) "
            f"stores {topk / 1e9:.1f} GB"
        )


def run_kld(job: CostJob) -> None:
    """``kld.runs`` passes of the candidate, each one engine over the prompt and the suite's windows."""
    checkpoint, what = candidate_bytes(job.cfg, job.geometry, job.candidate)
    job.notes.append(what)
    sets = [prompt_windows(job)] + [s for s in [suite_windows(job)] if s is not None]
    one = _engine_pass(job, checkpoint, sets, record=False)
    _apply(job, [one] * job.cfg.kld.runs)


def _compared_sides(job: CostJob) -> tuple[int, int]:
    """(run_kld outputs a gate reads -- its own and the baseline's --, those of the engine floor)."""
    kld = job.cfg.kld
    sides = 2 if kld.baseline is not None else 1
    bf16 = any(c.source == "bf16" for c in kld.candidates) and "bfloat16" in kld.kv_cache_dtypes
    return sides, 1 if bf16 else 0


def gate_kld(job: CostJob) -> None:
    """The prompt's paired bootstrap over positions; with the suite, the runs' per-position KL of the
    candidate, the baseline and the engine floor, the bootstrap over windows (stratified by domain) and the
    per-domain intervals."""
    cfg, hw = job.cfg, job.hw
    prompt = prompt_windows(job)
    sides, floor = _compared_sides(job)
    runs = cfg.kld.runs
    samples = cfg.kld.gates.bootstrap_samples
    job.read = runs * sides * (prompt.positions * prompt.per_position_bytes + RUN_JSON_BYTES)
    flops = samples * prompt.positions * BOOTSTRAP_FLOPS_PER_DRAW
    job.host += 3 * samples * prompt.positions * 8  # resampled indices and the paired means
    job.written = prompt.positions * 8 + 20_000
    suite = suite_windows(job)
    if suite is not None:
        outputs = runs * (sides + floor)
        domains = len(cfg.kld.eval.domains)
        job.read += outputs * (suite.positions * suite.per_position_bytes + RUN_JSON_BYTES)
        job.read += suite.windows * suite.tokens * 4 + RUN_JSON_BYTES  # the windows, the noise floor
        # the runs' mean per position; the mean's and the reduction's bootstrap over windows, each over the
        # whole suite and per domain
        flops += outputs * suite.positions * BOOTSTRAP_FLOPS_PER_DRAW
        flops += 2 * samples * suite.windows * 2 * BOOTSTRAP_FLOPS_PER_DRAW
        job.host += outputs * suite.positions * 8 + suite.positions * suite.per_position_bytes
        job.host += 3 * samples * suite.windows * 8
        job.written += suite.positions * 8 + domains * 2_000
    job.compute_s = flops / hw.cpu_forward_flops_per_core


def kld_report(job: CostJob) -> None:
    """Every gate side by side: the tables, the plots per KV dtype; with the suite, the per-domain rows,
    the decomposition, the pairwise reductions (bootstrap over windows) and the CDF per domain."""
    cfg, hw = job.cfg, job.hw
    kvs = len(cfg.kld.kv_cache_dtypes)
    pairs = len(cfg.kld.candidates) * kvs
    prompt = prompt_windows(job)
    plots = PLOTS_PER_KV * kvs
    job.read = pairs * (prompt.positions * 8 + 20_000)
    job.written = pairs * 2000 + plots * 150_000
    job.host += 512 * MIB
    flops = 0.0
    suite = suite_windows(job)
    if suite is not None:
        plots += kvs  # the CDF per domain
        job.read += pairs * suite.positions * 8 + suite.windows * suite.tokens * 4
        # the CDF per domain; the per-domain and the decomposition tables
        job.written += kvs * 150_000 + 2 * pairs * len(cfg.kld.eval.domains) * 500
        job.host += 2 * pairs * suite.positions * 8  # every curve, and one figure's sorted copies
        searched = sum(1 for c in cfg.kld.candidates if c.source == "searched")
        flops = searched * pairs * cfg.kld.gates.bootstrap_samples * suite.windows * BOOTSTRAP_FLOPS_PER_DRAW
    job.compute_s = plots * hw.plot_s + flops / hw.cpu_forward_flops_per_core


def check_kld_gates(job: CostJob) -> None:
    job.read, job.written = 50_000, 20_000
