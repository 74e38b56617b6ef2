"""The BF16 reference in bounded form: top-k log-probabilities plus the tail, and KL with a stated bound.

At real scale the full reference (float32 logits ``[N, V]``) is too large to keep: 250K positions x 131,072
tokens x 4 B = 131 GB. :func:`reduce_reference` keeps, per position, only what KL(reference || candidate)
needs from the reference side, and :func:`kld_statistics_topk` computes KL from that and the candidate's
full logits, exactly where it can and with a per-position interval where it cannot.

What is kept (per position; ``lp`` = the float32 ``log_softmax`` of the reference, ``S_p`` = the float64
sum of ``exp(lp)``, the normalisation of :mod:`mixquant.kld.stats`, so ``ln p = lp - ln S_p``):

* ``top_ids`` int32 ``[N, k]``: the k tokens with the largest reference logits, by descending logit (so by
  descending log-prob: the float32 ``log_softmax`` is monotone), ties by lowest id; ``top_ids[:, 0]`` is
  the reference argmax (first maximum), the token :func:`kld_statistics` compares for top-1 agreement;
* ``top_logp`` float32 ``[N, k]``: ``lp`` of those tokens and ``log_norm`` float64 ``[N]``: ``ln S_p``
  (``ln p = top_logp - log_norm``, in float64). Keeping the float32 ``lp`` as it was computed, with its
  correction beside it, is what makes ``k = V`` reproduce :func:`kld_statistics` bit for bit (a
  pre-corrected float32 log-prob would be rounded a second time);
* ``tail_mass`` float64 ``[N]``: ``m = sum_tail p``, the float64 sum of the tail's probabilities (the tail
  = the vocabulary minus that position's top-k), not ``1 - sum_top p``, which would cancel;
* ``tail_plogp`` float64 ``[N]``: ``sum_tail p ln p``;
* ``next_logp`` float64 ``[N]``: ``ln p(next token)``, exact whether or not it is in the top-k.

Storage: ``k * (4 + 4) + 4 * 8`` bytes per position (:func:`reference_bytes`) against ``V * 4``
(:func:`full_reference_bytes`); at k = 1,024 and V = 131,072, 8,224 B against 524,288 B (1.6 %).

The KL. With the candidate's full logits (``ln q`` exact for every token)

    KL = sum_top p (ln p - ln q)  +  tail_plogp  -  sum_tail p ln q

and only the last term is unknown: the tail's probabilities are known only through their sum ``m``. Two
lower bounds and one upper bound follow, each exact for every position (``A`` = the known part, ``Q_tail =
sum_tail q``):

    range:   A - m * max_tail ln q  <=  KL  <=  A - m * min_tail ln q
    merged:  sum_top p (ln p - ln q) + m ln(m / Q_tail)  <=  KL

The range holds because ``sum_tail p ln q`` is ``m`` times a mean of the tail's ``ln q``; the merged bound
is the data-processing inequality (KL of the two distributions with the tail merged into one token).
``kl_low`` is the larger of the two lower bounds (the merged one is never below 0 and is the one that
matters in practice), ``kl_high`` the range's upper bound. The point estimate ``kl`` takes the tail's
conditional distribution to be the candidate's, ``sum_tail p ln q ~ m * sum_tail (q / Q_tail) ln q``,
clamped into ``[kl_low, kl_high]``. The interval's width shrinks as k grows (less tail mass, a narrower tail
range) and is 0 when the tail is empty (k = V: all three are the exact KL) or carries no mass. It is tight
when the reference's probability is concentrated in its top-k (peaked next-token distributions); the upper
bound is loose where the tail holds real mass, as it allows all of it on the candidate's least likely token
(tens of nats). The lower bound and the point estimate err only by how much the two models' tail shapes
differ, so they stay close to the exact KL long before the upper bound does.

Numerics: those of :func:`kld_statistics` -- per chunk of ``chunk_rows`` rows, float32 ``log_softmax``,
the products ``p * (lp - lq)`` in float32 added in float64, the normalisations ``S_p`` / ``S_q`` corrected
for in float64. In the raw scale ``p' = exp(lp)``, ``q' = exp(lq)`` (``P = sum_top p' + sum_tail p' =
S_p``, ``S_q = sum_top q' + sum_tail q'``) the KL is ``(sum_top p' (lp - lq) + sum_tail p' lp - sum_tail p'
lq) / P - ln P + ln S_q``. For k = V that is :func:`kld_statistics`' own expression term by term (the
top-k terms are summed in vocabulary order), hence bit-identical. The tail sums ``sum x`` and ``sum x lx``
(each ``x lx`` formed in float64, exactly) are computed, normalised and stored, and brought back, by the
same code for the candidate as for the reference, so equal logits give bit-equal sums and exactly 0.0 for
``kl`` and ``kl_low`` at any k: a self-check stays exactly 0. Where the candidate's tail ``q'`` underflow
in float32 (their sum below ``TAIL_UNDERFLOW``), its tail sums are recomputed shifted by the tail's maximum.

Conventions (per position), those of :mod:`mixquant.kld.stats` where the reference is known:

* all three values are clamped at 0.0;
* a top-k token whose reference log-prob is ``-inf`` contributes 0; a candidate ``-inf`` where a top-k
  token's reference log-prob is finite makes all three ``inf``;
* the tail is known only through its mass: a tail of mass 0 (empty, all ``-inf``, or underflowed in float32)
  contributes 0 whatever the candidate has there. With tail mass > 0, a candidate ``-inf`` somewhere in the
  tail makes ``kl_high`` ``inf`` (the reference might have mass there), and a candidate that is ``-inf`` on
  the whole tail makes all three ``inf``;
* rows with NaN or ``+inf`` logits, or all ``-inf``, raise ``ValueError`` (reference or candidate);
* ``top1_same`` compares ``top_ids[:, 0]`` with the candidate's first maximum of its (float32-cast) logits.

Per-position values are bit-identical for any ``chunk_rows`` (each row's results depend only on that row).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from mixquant.kld.stats import _as_float32, _log_softmax_into, _row_argmax, _row_sums_f64, summarize

__all__ = [
    "REDUCED_KEYS",
    "full_reference_bytes",
    "kld_statistics_topk",
    "reduce_reference",
    "reference_bytes",
]

# name -> (dtype, per-position shape: "k" for [N, k], "" for [N]), in the order a file lists them.
REDUCED_KEYS: dict[str, tuple[torch.dtype, str]] = {
    "top_ids": (torch.int32, "k"),
    "top_logp": (torch.float32, "k"),
    "log_norm": (torch.float64, ""),
    "tail_mass": (torch.float64, ""),
    "tail_plogp": (torch.float64, ""),
    "next_logp": (torch.float64, ""),
}


# A candidate tail whose float32 q' sum to less than this is recomputed shifted by its maximum (terms that
# underflow, each < 1.5e-45, would otherwise matter).
TAIL_UNDERFLOW = 1e-30


def reference_bytes(positions: int, top_k: int) -> int:
    """Bytes of the tensors :func:`reduce_reference` keeps for ``positions`` positions (no file headers)."""
    per_position = sum(
        (top_k if shape == "k" else 1) * torch.empty((), dtype=dtype).element_size()
        for dtype, shape in REDUCED_KEYS.values()
    )
    return int(positions) * per_position


def full_reference_bytes(positions: int, vocab: int) -> int:
    """Bytes of full-vocabulary float32 reference logits ``[positions, vocab]`` (no file headers)."""
    return int(positions) * int(vocab) * 4


# --------------------------------------------------------------------------------------------------------
# shared helpers
# --------------------------------------------------------------------------------------------------------


def _check_distribution(name: str, sums: torch.Tensor, start: int) -> None:
    bad = ~(torch.isfinite(sums) & (sums > 0))
    if bool(bad.any()):
        pos = start + int(bad.nonzero()[0, 0])
        raise ValueError(
            f"{name} logits at position {pos} are not a distribution (NaN or +inf entries, "
            "or every entry -inf)"
        )


def _check_logits(name: str, logits: torch.Tensor, tokens: torch.Tensor, chunk_rows: int) -> None:
    if logits.dim() != 2 or logits.shape[0] < 1 or logits.shape[1] < 1:
        raise ValueError(f"{name} logits must be a non-empty [N, V]; got {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"{name} logits must be floating point, got {logits.dtype}")
    n, v = logits.shape
    if tokens.dim() != 1 or tokens.shape[0] != n:
        raise ValueError(f"next_tokens must be [N={n}]; got {tuple(tokens.shape)}")
    if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise ValueError(f"next_tokens must be integer, got {tokens.dtype}")
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= v:
        raise ValueError(f"next_tokens out of range [0, {v}): min {lo}, max {hi}")
    if int(chunk_rows) < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")


def _top_ids(a: torch.Tensor, k: int) -> torch.Tensor:
    """Ids of the k largest entries of each row of ``a`` [R, V], by descending value, ties by lowest id.

    ``topk`` gives the k-th largest value; every entry above it is in, and of the entries equal to it the
    lowest ids fill what is left (``topk`` alone picks among ties arbitrarily). A stable sort of the k
    chosen ids (ascending) by descending value then orders ties by id.
    """
    kth = torch.topk(a, k, dim=1, sorted=False).values.amin(dim=1, keepdim=True)
    chosen = a > kth
    equal = a == kth
    need = k - chosen.sum(dim=1, keepdim=True)
    if bool((equal.sum(dim=1, keepdim=True) > need).any()):
        equal &= torch.cumsum(equal, dim=1) <= need
    chosen |= equal
    ids = chosen.nonzero()[:, 1].view(a.shape[0], k)  # row-major: ascending ids in each row
    order = torch.sort(a.gather(1, ids), dim=1, descending=True, stable=True).indices
    return ids.gather(1, order)


def _tail_sums(
    x: torch.Tensor, lx: torch.Tensor, s: torch.Tensor, ln_s: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(m, h)``: the tail's probability mass and ``sum p ln p`` from ``x = exp(lx)`` [R, V] (float32, 0
    outside the tail) and the row normalisation ``s = sum exp(lx)``, ``ln_s`` (float64 [R]).

    ``p = x / s`` and ``ln p = lx - ln s``, so ``h = sum x lx / s - m ln s``; each ``x lx`` is formed in
    float64 (exact: a product of two float32) and 0 where ``x = 0``. Both sides call this, so that equal
    logits give bit-equal sums.
    """
    mass = _row_sums_f64(x) / s
    xlx = torch.where(x > 0, x.double() * lx.double(), torch.zeros((), dtype=torch.float64, device=x.device))
    return mass, _row_sums_f64(xlx) / s - mass * ln_s


def _raw_tail_sums(
    mass: torch.Tensor, plogp: torch.Tensor, ln_s: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_tail_sums` back in the raw scale of ``x``: ``(sum_tail x, sum_tail x lx)``, with ``s`` taken
    as ``exp(ln_s)`` (all that the stored reference has)."""
    s = torch.exp(ln_s)
    return mass * s, (plogp + mass * ln_s) * s


# --------------------------------------------------------------------------------------------------------
# capture side
# --------------------------------------------------------------------------------------------------------


@torch.no_grad()
def reduce_reference(
    ref_logits: torch.Tensor, next_tokens: torch.Tensor, top_k: int, *, chunk_rows: int = 64
) -> dict[str, torch.Tensor]:
    """The bounded form of reference logits ``[N, V]``: CPU tensors named by :data:`REDUCED_KEYS`.

    ``top_k`` in ``[1, V]``; ``next_tokens`` ``[N]`` integer, the prompt's actual next tokens. See the
    module docstring for what each tensor holds. Extra memory is O(chunk_rows * V).
    """
    _check_logits("ref", ref_logits, next_tokens, chunk_rows)
    n, v = ref_logits.shape
    k = int(top_k)
    if not 1 <= k <= v:
        raise ValueError(f"top_k must be in [1, V={v}], got {top_k}")
    rows = min(int(chunk_rows), n)
    device = ref_logits.device
    tokens = next_tokens.to(device=device, dtype=torch.int64)

    def work() -> torch.Tensor:
        return torch.empty((rows, v), dtype=torch.float32, device=device)

    cast_buf = work() if ref_logits.dtype != torch.float32 else None
    lp_buf, p_buf = work(), work()

    out = {
        name: torch.empty((n, k) if shape == "k" else (n,), dtype=dtype)
        for name, (dtype, shape) in REDUCED_KEYS.items()
    }
    for start in range(0, n, rows):
        stop = min(start + rows, n)
        r = stop - start
        a = _as_float32(ref_logits[start:stop].detach(), cast_buf)
        lp = _log_softmax_into(a, lp_buf[:r])
        p = torch.exp(lp, out=p_buf[:r])
        s_p = _row_sums_f64(p)
        _check_distribution("reference", s_p, start)
        ln_s_p = torch.log(s_p)

        ids = _top_ids(a, k)
        tail = torch.ones((r, v), dtype=torch.bool, device=device)
        tail.scatter_(1, ids, False)
        p.masked_fill_(~tail, 0.0)
        tail_mass, tail_plogp = _tail_sums(p, lp, s_p, ln_s_p)
        out["top_ids"][start:stop] = ids.to(torch.int32).cpu()
        out["top_logp"][start:stop] = lp.gather(1, ids).cpu()
        out["log_norm"][start:stop] = ln_s_p
        out["tail_mass"][start:stop] = tail_mass
        out["tail_plogp"][start:stop] = tail_plogp
        out["next_logp"][start:stop] = lp.gather(1, tokens[start:stop, None])[:, 0].double().cpu() - ln_s_p
    return out


# --------------------------------------------------------------------------------------------------------
# comparison side
# --------------------------------------------------------------------------------------------------------


def _check_reduced(reduced: Mapping[str, torch.Tensor], cand: torch.Tensor) -> None:
    missing = [name for name in REDUCED_KEYS if name not in reduced]
    if missing:
        raise ValueError(f"reduced reference lacks {missing}: build it with reduce_reference")
    n, v = cand.shape
    k = int(reduced["top_ids"].shape[-1]) if reduced["top_ids"].dim() == 2 else -1
    for name, (dtype, shape) in REDUCED_KEYS.items():
        want = (n, k) if shape == "k" else (n,)
        got = reduced[name]
        if tuple(got.shape) != want or got.dtype != dtype:
            raise ValueError(
                f"reduced[{name!r}] is {got.dtype} {tuple(got.shape)}, expected {dtype} {want} "
                f"for candidate logits {tuple(cand.shape)}"
            )
    if not 1 <= k <= v:
        raise ValueError(f"reduced reference keeps top-{k}, candidate vocabulary is {v}")


@torch.no_grad()
def kld_statistics_topk(
    reduced: Mapping[str, torch.Tensor],
    cand_logits: torch.Tensor,
    next_tokens: torch.Tensor,
    *,
    chunk_rows: int = 64,
) -> dict[str, Any]:
    """KL(reference || candidate) from a :func:`reduce_reference` reference and full candidate logits.

    Returns what :func:`mixquant.kld.stats.kld_statistics` returns, ``{"per_position": {...}, "summary":
    {...}}``, with per_position ``kl`` the point estimate plus ``kl_low`` / ``kl_high`` (float64 [N], the
    bound); the reference's next-token values come from ``next_logp``, the candidate's are exact. The
    summary adds ``mean_kld_low``, ``mean_kld_high`` and ``max_kl_bound_width`` (largest ``kl_high -
    kl_low``; 0 where both are ``inf``). Extra memory is O(chunk_rows * V).
    """
    _check_logits("cand", cand_logits, next_tokens, chunk_rows)
    _check_reduced(reduced, cand_logits)
    n, v = cand_logits.shape
    rows = min(int(chunk_rows), n)
    device = cand_logits.device
    tokens = next_tokens.to(device=device, dtype=torch.int64)

    def work() -> torch.Tensor:
        return torch.empty((rows, v), dtype=torch.float32, device=device)

    cast_buf = work() if cand_logits.dtype != torch.float32 else None
    lq_buf, e_buf, s_buf = work(), work(), work()
    zero = torch.zeros((), dtype=torch.float32, device=device)

    values = {name: torch.empty(n, dtype=torch.float64) for name in ("kl", "kl_low", "kl_high")}
    top1 = torch.empty(n, dtype=torch.bool)
    ln_p_cand = torch.empty(n, dtype=torch.float64)

    for start in range(0, n, rows):
        stop = min(start + rows, n)
        r = stop - start
        b = _as_float32(cand_logits[start:stop].detach(), cast_buf)
        ids = reduced["top_ids"][start:stop].to(device=device, dtype=torch.int64)
        top_lp = reduced["top_logp"][start:stop].to(device)
        ln_s_p = reduced["log_norm"][start:stop]

        top1[start:stop] = ids[:, 0].cpu() == _row_argmax(b)
        lq = _log_softmax_into(b, lq_buf[:r])
        q = torch.exp(lq, out=e_buf[:r])  # q' = exp(lq), S_q = sum q'
        s_q = _row_sums_f64(q)
        _check_distribution("candidate", s_q, start)
        ln_s_q_full = torch.log(s_q)
        ln_p_cand[start:stop] = lq.gather(1, tokens[start:stop, None])[:, 0].double().cpu() - ln_s_q_full
        q_top = q.gather(1, ids)

        # the candidate's tail, in the reference's arithmetic: Q' = sum_tail q', H' = sum_tail q' lq
        tail = torch.ones((r, v), dtype=torch.bool, device=device)
        tail.scatter_(1, ids, False)
        q.masked_fill_(~tail, 0.0)
        # the reference's tail sums' own arithmetic and round trip: bit-equal to them for equal logits
        q_tail, qlogq_tail = _raw_tail_sums(*_tail_sums(q, lq, s_q, ln_s_q_full), ln_s_q_full)
        lq_max = lq.masked_fill(~tail, -math.inf).amax(dim=1)
        lq_min = lq.masked_fill(~tail, math.inf).amin(dim=1)

        # the top-k: p' (lp - lq) in float32, summed in float64 in vocabulary order, as kld_statistics does
        lq_top = lq.gather(1, ids)
        p_top = torch.exp(top_lp)
        terms = p_top * (top_lp - lq_top)
        top_inf = (torch.isfinite(top_lp) & torch.isneginf(lq_top)).any(dim=1).cpu()
        terms = torch.where(torch.isfinite(terms), terms, zero)  # NaN only where p' = 0
        grid = s_buf[:r].zero_()
        dot_top = _row_sums_f64(grid.scatter_(1, ids, terms))
        s_top = _row_sums_f64(grid.zero_().scatter_(1, ids, p_top))
        s_top_q = _row_sums_f64(grid.zero_().scatter_(1, ids, q_top))
        # S_q as top-k + tail: bit-equal to the reference's S_p when the logits are (a self-check gives 0.0)
        ln_s_q = torch.log(s_top_q + q_tail)

        # the reference's tail back in the raw scale of p' = exp(lp): m' = sum_tail p', h' = sum_tail p' lp
        tail_mass_raw, tail_plogp_raw = _raw_tail_sums(
            reduced["tail_mass"][start:stop], reduced["tail_plogp"][start:stop], ln_s_p
        )
        has_tail = tail_mass_raw > 0
        lq_max, lq_min = lq_max.double().cpu(), lq_min.double().cpu()
        tail_dead = has_tail & torch.isneginf(lq_max)  # the candidate gives the whole tail q = 0
        tail_open = has_tail & torch.isneginf(lq_min)  # the reference may have mass where q = 0
        ln_q_tail = torch.log(q_tail)
        scale = tail_mass_raw / q_tail
        underflow = has_tail & ~tail_dead & (q_tail < TAIL_UNDERFLOW)
        if bool(underflow.any()):  # q' underflows in float32 there: shift by the tail's max first
            shifted = torch.sub(lq, lq_max.to(device, torch.float32)[:, None], out=s_buf[:r])
            weight = torch.exp(shifted.masked_fill_(~tail, -math.inf), out=e_buf[:r])
            w_sum = _row_sums_f64(weight)
            ws_sum = _row_sums_f64(torch.where(weight > 0, weight * shifted, zero))
            ln_q_tail = torch.where(underflow, lq_max + torch.log(w_sum), ln_q_tail)
            scale = torch.where(underflow, tail_mass_raw / w_sum, scale)  # m' / W: H' / Q' = max + ws / W
            qlogq_tail = torch.where(underflow, lq_max * w_sum + ws_sum, qlogq_tail)

        # each estimate's tail term, added to the top-k's sum p' (lp - lq) in the raw scale
        nothing = torch.zeros((), dtype=torch.float64)
        point = tail_plogp_raw - scale * qlogq_tail
        tail_terms = {
            # the tail's conditional distribution taken to be the candidate's: sum_tail p' lq ~ m' H' / Q'
            "kl": point,
            # never above the point (H' / Q' <= max_tail lq), so that rounding cannot lift it over a 0.0
            "kl_low": torch.minimum(tail_plogp_raw - tail_mass_raw * lq_max, point),
            # the tail merged into one token: a lower bound by the data-processing inequality
            "merged": tail_mass_raw * (torch.log(tail_mass_raw) - ln_q_tail),
            "kl_high": tail_plogp_raw - tail_mass_raw * torch.where(tail_open, nothing, lq_min),
        }
        p_total = s_top + tail_mass_raw
        ln_p_total = torch.log(p_total)
        chunk = {}
        for name, tail_term in tail_terms.items():
            kl = (dot_top + torch.where(has_tail, tail_term, nothing)) / p_total - ln_p_total + ln_s_q
            kl[top_inf | tail_dead | (tail_open if name == "kl_high" else False)] = math.inf
            if bool(torch.isnan(kl).any()):
                pos = start + int(torch.isnan(kl).nonzero()[0, 0])
                raise ValueError(f"{name} at position {pos} is NaN for valid logits (overflow?)")
            chunk[name] = kl
        low = torch.maximum(chunk["kl_low"], chunk["merged"])
        high = chunk["kl_high"]
        values["kl_low"][start:stop] = low.clamp(min=0.0)
        values["kl_high"][start:stop] = high.clamp(min=0.0)
        values["kl"][start:stop] = torch.minimum(torch.maximum(chunk["kl"], low), high).clamp_(min=0.0)

    ln_p_ref = reduced["next_logp"].to(torch.float64)
    per_position = {
        "kl": values["kl"],
        "kl_low": values["kl_low"],
        "kl_high": values["kl_high"],
        "top1_same": top1,
        "p_ref": ln_p_ref.exp(),
        "p_cand": ln_p_cand.exp(),
        "ref_nll": -ln_p_ref,
        "cand_nll": -ln_p_cand,
    }
    summary = summarize(per_position)
    low, high = values["kl_low"], values["kl_high"]
    width = torch.where(torch.isinf(low), torch.zeros((), dtype=torch.float64), high - low)
    summary["mean_kld_low"] = float(np.mean(low.numpy()))  # NumPy's sum, as summarize's mean_kld
    summary["mean_kld_high"] = float(np.mean(high.numpy()))
    summary["max_kl_bound_width"] = float(width.max())
    return {"per_position": per_position, "summary": summary}
