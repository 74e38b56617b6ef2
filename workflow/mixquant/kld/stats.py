"""Per-position KL(reference || candidate) over a prompt and llama.cpp-style summary statistics.

:func:`kld_statistics` walks the ``[N, V]`` logits ``chunk_rows`` rows at a time (extra memory
O(chunk_rows * V): three float32 work buffers, plus two for the float32 casts of non-float32 inputs). Per
chunk, in float32: ``lp = log_softmax(ref)``, ``lq = log_softmax(cand)``, ``t = lp - lq``, ``p = exp(lp)``;
in float64: the row sums ``S_p = sum(p)``, ``S_q = sum(exp(lq))`` and ``sum(p * t)`` (each float32 term
added in float64). The KL of a position is

    KL = sum(p * t) / S_p - ln S_p + ln S_q

which equals ``sum(p * (lp - lq))`` mathematically (``S_p = S_q = 1``) but cancels the row-constant error
of float32 ``log_softmax`` (its float32 log-sum-exp is off by up to ~1e-6). What is left is per-element
float32 rounding: against a float64 computation on the same float32 logits, a few 1e-8 absolute (tested:
<= 1e-7 + 3e-5 x KL), where the plain float32 ``sum(p * (lp - lq))`` is off by ~5e-7.
Bit-identical inputs give exactly ``t = 0``, ``S_p = S_q``, so KL is exactly 0.0. The next-token
probabilities and NLLs use the same corrected normalisation (``ln p(next) = lp[next] - ln S_p``).

Conventions (all per position):

* KL >= 0 mathematically; rounding can leave values down to a few -1e-8, which are clamped to 0.0.
* A reference logit of ``-inf`` (p = 0) contributes 0, whatever the candidate has there, and so do
  tokens whose float32 probability underflows to 0 while both logits are finite.
* A candidate logit of ``-inf`` where the reference logit is finite (p > 0 mathematically, even if it
  underflows in float32) makes KL ``+inf``: reported as ``inf``, never NaN, and never silently dropped.
* A row that has no valid distribution -- a NaN or ``+inf`` logit, or every logit ``-inf`` -- raises
  ``ValueError`` (reference or candidate).
* Top-1 agreement compares ``argmax`` of the (float32-cast) raw logits; ties go to the lowest token id on
  both sides (NumPy's / PyTorch's first-maximum rule), as llama.cpp's strict ``>`` scan does.

On CPU, argmax and the float64 row sums use NumPy (vectorised, single pass, row results independent of
the chunking); elementwise work and ``log_softmax`` use PyTorch's intra-op threads. Per-position values
are bit-identical for any ``chunk_rows``. Other devices use PyTorch throughout (untested: no GPU in CI).

:func:`summarize` reproduces the statistics of llama.cpp's ``perplexity --kl-divergence`` report; see its
docstring for the definitions (percentiles, standard errors).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["KLD_PERCENTILES", "DP_PERCENTILES", "kld_statistics", "percentiles", "summarize"]

# (key suffix, fraction): the percentile rows of llama.cpp's KL report, in its order.
KLD_PERCENTILES: tuple[tuple[str, float], ...] = (
    ("p99_9", 0.999),
    ("p99", 0.99),
    ("p95", 0.95),
    ("p90", 0.90),
    ("median", 0.5),
    ("p10", 0.10),
    ("p5", 0.05),
    ("p1", 0.01),
    ("p0_1", 0.001),
)
DP_PERCENTILES: tuple[tuple[str, float], ...] = (
    ("p99_9", 0.999),
    ("p99", 0.99),
    ("p95", 0.95),
    ("p90", 0.90),
    ("p75", 0.75),
    ("median", 0.5),
    ("p25", 0.25),
    ("p10", 0.10),
    ("p5", 0.05),
    ("p1", 0.01),
    ("p0_1", 0.001),
)
PER_POSITION_KEYS = ("kl", "top1_same", "p_ref", "p_cand", "ref_nll", "cand_nll")


# --------------------------------------------------------------------------------------------------------
# per-position statistics
# --------------------------------------------------------------------------------------------------------


def _row_sums_f64(x: torch.Tensor) -> torch.Tensor:
    """Float64 sums of the rows of a float32 ``[R, V]`` tensor, each float32 term added in float64.

    CPU: NumPy's buffered cast-and-add (pairwise within 8192-element blocks) -- no float64 copy of ``x``,
    and each row's result depends only on that row. Elsewhere: ``torch.sum(dtype=float64)``.
    """
    if x.device.type == "cpu":
        return torch.from_numpy(np.sum(x.numpy(), axis=1, dtype=np.float64))
    return x.sum(dim=1, dtype=torch.float64).cpu()


def _row_argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of the first maximum of each row (NumPy on CPU: ~10x faster than ``torch.argmax`` there)."""
    if x.device.type == "cpu":
        return torch.from_numpy(np.asarray(x.numpy().argmax(axis=1), dtype=np.int64))
    return x.argmax(dim=1).cpu()


def _as_float32(x: torch.Tensor, buf: torch.Tensor | None) -> torch.Tensor:
    """``x`` itself when float32, else ``x`` cast into the slice of ``buf`` (a reused work buffer)."""
    if x.dtype == torch.float32:
        return x
    assert buf is not None
    out = buf[: x.shape[0]]
    out.copy_(x)
    return out


def _log_softmax_into(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``log_softmax(x, -1)`` written into ``out`` (no allocation per chunk)."""
    torch.ops.aten._log_softmax.out(x, -1, False, out=out)
    return out


def _validate(ref: torch.Tensor, cand: torch.Tensor, tokens: torch.Tensor, chunk_rows: int) -> None:
    if ref.dim() != 2 or cand.dim() != 2:
        raise ValueError(f"logits must be [N, V]; got ref {tuple(ref.shape)}, cand {tuple(cand.shape)}")
    if ref.shape != cand.shape:
        raise ValueError(f"ref and cand logits differ in shape: {tuple(ref.shape)} vs {tuple(cand.shape)}")
    if ref.shape[0] < 1 or ref.shape[1] < 1:
        raise ValueError(f"empty logits {tuple(ref.shape)}")
    if ref.device != cand.device:
        raise ValueError(f"ref ({ref.device}) and cand ({cand.device}) logits are on different devices")
    for name, x in (("ref", ref), ("cand", cand)):
        if not x.is_floating_point():
            raise ValueError(f"{name} logits must be floating point, got {x.dtype}")
    if tokens.dim() != 1 or tokens.shape[0] != ref.shape[0]:
        raise ValueError(f"next_tokens must be [N={ref.shape[0]}]; got {tuple(tokens.shape)}")
    if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise ValueError(f"next_tokens must be integer, got {tokens.dtype}")
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= ref.shape[1]:
        raise ValueError(f"next_tokens out of range [0, {ref.shape[1]}): min {lo}, max {hi}")
    if int(chunk_rows) < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")


def _exact_dot(a: torch.Tensor, b: torch.Tensor) -> float:
    """``sum(p * (lp - lq))`` of one row pair, over ``p > 0`` only; ``inf`` if the candidate has ``-inf``
    where the reference is finite (p > 0 mathematically, even if it underflows in float32).

    The slow path for the rare rows whose fast-path sum is not finite: there the NaNs come from
    ``0 * -inf`` / ``0 * nan`` where p = 0, or the ``+inf`` from a candidate ``-inf``.
    """
    lp = torch.log_softmax(a.unsqueeze(0), dim=-1)
    lq = torch.log_softmax(b.unsqueeze(0), dim=-1)
    t = lp - lq
    if bool(torch.isposinf(t).any()):
        return math.inf
    p = lp.exp()
    terms = torch.where(p > 0, p * t, torch.zeros((), dtype=t.dtype, device=t.device))
    return float(_row_sums_f64(terms)[0])


@torch.no_grad()
def kld_statistics(
    ref_logits: torch.Tensor,
    cand_logits: torch.Tensor,
    next_tokens: torch.Tensor,
    *,
    chunk_rows: int = 64,
) -> dict[str, Any]:
    """KL(reference || candidate) and next-token statistics of every position, plus :func:`summarize`.

    ``ref_logits`` / ``cand_logits``: ``[N, V]`` (float32, bf16 or any float dtype; cast to float32 a chunk
    at a time; N = T-1 prompt positions), ``next_tokens``: ``[N]`` integer, the prompt's actual next tokens.
    Returns ``{"per_position": {...}, "summary": summarize(per_position)}`` where ``per_position`` holds CPU
    tensors: ``kl`` float64[N], ``top1_same`` bool[N], ``p_ref`` / ``p_cand`` float64[N] (probability of
    the next token), ``ref_nll`` / ``cand_nll`` float64[N] (``-ln p``). See the module docstring for the
    numerics and the ``-inf`` / NaN conventions.
    """
    _validate(ref_logits, cand_logits, next_tokens, chunk_rows)
    n, v = ref_logits.shape
    rows = min(int(chunk_rows), n)
    device = ref_logits.device
    tokens = next_tokens.to(device=device, dtype=torch.int64)

    def work() -> torch.Tensor:
        return torch.empty((rows, v), dtype=torch.float32, device=device)

    w_buf = torch.empty((2 * rows, v), dtype=torch.float32, device=device)  # [lp; lq], then [p; exp(lq)]
    t_buf = work()
    ref_buf = work() if ref_logits.dtype != torch.float32 else None
    cand_buf = work() if cand_logits.dtype != torch.float32 else None

    kl = torch.empty(n, dtype=torch.float64)
    top1 = torch.empty(n, dtype=torch.bool)
    ln_p_ref = torch.empty(n, dtype=torch.float64)
    ln_p_cand = torch.empty(n, dtype=torch.float64)

    for start in range(0, n, rows):
        stop = min(start + rows, n)
        r = stop - start
        a = _as_float32(ref_logits[start:stop].detach(), ref_buf)
        b = _as_float32(cand_logits[start:stop].detach(), cand_buf)
        tok = tokens[start:stop].unsqueeze(1)

        top1[start:stop] = _row_argmax(a) == _row_argmax(b)

        w = w_buf[: 2 * r]  # one block, so that exp and the row sums run once for both halves
        lp = _log_softmax_into(a, w[:r])
        lq = _log_softmax_into(b, w[r:])
        lp_next = lp.gather(1, tok).squeeze(1).double().cpu()
        lq_next = lq.gather(1, tok).squeeze(1).double().cpu()

        t = torch.sub(lp, lq, out=t_buf[:r])  # t = lp - lq
        w.exp_()  # w = [p; exp(lq)]
        sums = _row_sums_f64(w)
        s_p, s_q = sums[:r], sums[r:]
        p = lp
        for name, s in (("reference", s_p), ("candidate", s_q)):
            bad = ~(torch.isfinite(s) & (s > 0))
            if bool(bad.any()):
                pos = start + int(bad.nonzero()[0, 0])
                raise ValueError(
                    f"{name} logits at position {pos} are not a distribution (NaN or +inf entries, "
                    "or every entry -inf)"
                )
        dot = _row_sums_f64(t.mul_(p))  # sum(p * t)
        ln_s_p, ln_s_q = torch.log(s_p), torch.log(s_q)
        chunk_kl = dot / s_p - ln_s_p + ln_s_q
        nonfinite = ~torch.isfinite(chunk_kl)
        if bool(nonfinite.any()):
            for i in nonfinite.nonzero().squeeze(1).tolist():
                dot_i = _exact_dot(a[i], b[i])
                value = dot_i / float(s_p[i]) - float(ln_s_p[i]) + float(ln_s_q[i])
                if math.isnan(value):
                    raise ValueError(f"KL at position {start + i} is NaN for valid logits (overflow?)")
                chunk_kl[i] = value
        kl[start:stop] = chunk_kl.clamp_(min=0.0)
        ln_p_ref[start:stop] = lp_next - ln_s_p
        ln_p_cand[start:stop] = lq_next - ln_s_q

    per_position = {
        "kl": kl,
        "top1_same": top1,
        "p_ref": ln_p_ref.exp(),
        "p_cand": ln_p_cand.exp(),
        "ref_nll": -ln_p_ref,
        "cand_nll": -ln_p_cand,
    }
    return {"per_position": per_position, "summary": summarize(per_position)}


# --------------------------------------------------------------------------------------------------------
# summary
# --------------------------------------------------------------------------------------------------------


def percentiles(values: Any, fractions: Sequence[float]) -> list[float]:
    """Percentiles of ``values`` at ``fractions`` (0..1), llama.cpp's definition.

    Linear interpolation between the sorted values at rank ``fraction * (n - 1)`` -- llama.cpp's
    ``percentile`` lambda in ``perplexity.cpp``, which is also NumPy's default (``method="linear"``); its
    median (mean of the two middle values for even n) is the 0.5 case. Computed in float64; equal
    neighbours are returned as is, so ``inf`` entries give ``inf``, not NaN.
    """
    x = np.sort(np.asarray(values, dtype=np.float64).ravel())
    if x.size == 0:
        raise ValueError("percentiles of an empty array")
    out = []
    for f in fractions:
        if not 0.0 <= f <= 1.0:
            raise ValueError(f"fraction {f} outside [0, 1]")
        pos = f * (x.size - 1)
        lo = min(int(math.floor(pos)), x.size - 1)
        hi = min(lo + 1, x.size - 1)
        frac = pos - lo
        a, b = float(x[lo]), float(x[hi])
        if frac == 0.0 or a == b:
            out.append(a)
        elif frac < 0.5:  # NumPy's two-sided lerp: exact at both ends
            out.append(a + (b - a) * frac)
        else:
            out.append(b - (b - a) * (1.0 - frac))
    return out


def _mean_se(x: np.ndarray) -> tuple[float, float]:
    """Mean and its standard error ``std(ddof=1) / sqrt(n)``; SE is NaN when n < 2 or x is not finite."""
    mean = float(np.mean(x))
    if x.size < 2 or not np.isfinite(x).all():
        return mean, math.nan
    return mean, float(np.std(x, ddof=1) / math.sqrt(x.size))


def _exp(x: float) -> float:
    """``exp(x)`` that gives ``inf`` instead of raising on overflow (and NaN for NaN)."""
    return math.inf if x > 709.0 else math.exp(x)


def _np(x: Any, dtype: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=dtype).ravel()


def summarize(per_position: Mapping[str, Any]) -> dict[str, float | int]:
    """llama.cpp's KL-divergence report from per-position values (tensors or arrays, as returned above).

    Keys (plain Python floats; ``positions`` and ``infinite_kld`` are ints):

    * ``positions``; ``mean_kld`` ± ``mean_kld_se``, ``max_kld``, ``kld_p99_9`` ... ``kld_p0_1`` (99.9, 99,
      95, 90, 10, 5, 1, 0.1 %), ``median_kld``, ``min_kld``; ``infinite_kld`` (positions with KL = inf).
    * ``same_top_pct`` ± ``same_top_pct_se``: top-1 agreement in percent, binomial SE
      ``100 * sqrt(p (1 - p) / n)`` (llama.cpp divides by n - 1; at n = 2,047 that is 0.02 % of the SE).
    * Δp = p_cand(next) - p_ref(next) as a probability (llama.cpp prints it x 100): ``mean_dp`` ±
      ``mean_dp_se``, ``rms_dp`` ± ``rms_dp_se`` (delta method, ``SE(mean Δp²) / (2 RMS)``),
      ``max_dp``, ``dp_p99_9`` ... ``dp_p0_1`` (99.9, 99, 95, 90, 75, 25, 10, 5, 1, 0.1 %), ``median_dp``,
      ``min_dp``.
    * ``ppl_ref`` / ``ppl_cand`` = exp(mean NLL) ± ``ppl_*_se`` (= PPL x SE of the mean NLL),
      ``ln_ppl_ratio`` = mean(cand_nll - ref_nll) ± ``ln_ppl_ratio_se`` (paired SE),
      ``ppl_ratio`` = exp(ln_ppl_ratio) ± ``ppl_ratio_se`` (= ratio x SE of the log ratio).

    Standard errors of means are ``std(ddof=1) / sqrt(n)`` -- the same number as llama.cpp's
    ``sqrt((Σx²/n - mean²) / (n - 1))``, computed stably -- NaN for n < 2 or non-finite data (KL = inf).
    Percentiles: :func:`percentiles`.
    """
    missing = [k for k in PER_POSITION_KEYS if k not in per_position]
    if missing:
        raise ValueError(f"per_position lacks {missing}")
    kl = _np(per_position["kl"], np.float64)
    n = kl.size
    if n == 0:
        raise ValueError("no positions to summarize")
    same = _np(per_position["top1_same"], bool)
    p_ref = _np(per_position["p_ref"], np.float64)
    p_cand = _np(per_position["p_cand"], np.float64)
    ref_nll = _np(per_position["ref_nll"], np.float64)
    cand_nll = _np(per_position["cand_nll"], np.float64)
    for name, arr in (("top1_same", same), ("p_ref", p_ref), ("p_cand", p_cand), ("ref_nll", ref_nll)):
        if arr.size != n:
            raise ValueError(f"per_position[{name!r}] has {arr.size} values, kl has {n}")
    if cand_nll.size != n:
        raise ValueError(f"per_position['cand_nll'] has {cand_nll.size} values, kl has {n}")

    out: dict[str, float | int] = {"positions": int(n)}
    out["mean_kld"], out["mean_kld_se"] = _mean_se(kl)
    out["max_kld"] = float(kl.max())
    for (key, _), value in zip(
        KLD_PERCENTILES, percentiles(kl, [f for _, f in KLD_PERCENTILES]), strict=True
    ):
        out["median_kld" if key == "median" else f"kld_{key}"] = value
    out["min_kld"] = float(kl.min())
    out["infinite_kld"] = int(np.isinf(kl).sum())

    top = float(same.mean())
    out["same_top_pct"] = 100.0 * top
    out["same_top_pct_se"] = 100.0 * math.sqrt(top * (1.0 - top) / n)

    dp = p_cand - p_ref
    out["mean_dp"], out["mean_dp_se"] = _mean_se(dp)
    mse, mse_se = _mean_se(dp * dp)
    out["rms_dp"] = math.sqrt(mse)
    out["rms_dp_se"] = 0.5 * mse_se / out["rms_dp"] if out["rms_dp"] > 0 else 0.0
    out["max_dp"] = float(dp.max())
    for (key, _), value in zip(DP_PERCENTILES, percentiles(dp, [f for _, f in DP_PERCENTILES]), strict=True):
        out["median_dp" if key == "median" else f"dp_{key}"] = value
    out["min_dp"] = float(dp.min())

    for name, nll in (("ref", ref_nll), ("cand", cand_nll)):
        mean, se = _mean_se(nll)
        ppl = _exp(mean)
        out[f"ppl_{name}"] = ppl
        out[f"ppl_{name}_se"] = ppl * se
    out["ln_ppl_ratio"], out["ln_ppl_ratio_se"] = _mean_se(cand_nll - ref_nll)
    ratio = _exp(out["ln_ppl_ratio"])
    out["ppl_ratio"] = ratio
    out["ppl_ratio_se"] = ratio * out["ln_ppl_ratio_se"]
    return out
