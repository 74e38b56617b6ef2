"""kld_statistics / summarize against a plain float64 computation (whole tensor, no chunking)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from mixquant.kld.stats import DP_PERCENTILES, KLD_PERCENTILES, kld_statistics, percentiles, summarize

# float32 log_softmax vs float64: ~1e-8 absolute (per-element rounding) + ~1e-5 relative at most.
KL_ATOL, KL_RTOL = 1e-7, 3e-5


def _reference(ref: torch.Tensor, cand: torch.Tensor, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Straightforward float64 statistics of the float32-cast logits, all rows at once."""
    a, b = ref.float().double(), cand.float().double()
    lp, lq = torch.log_softmax(a, dim=-1), torch.log_softmax(b, dim=-1)
    p = lp.exp()
    kl = torch.where(p > 0, p * (lp - lq), torch.zeros((), dtype=torch.float64)).sum(-1)
    kl[(torch.isfinite(a) & torch.isneginf(b)).any(-1)] = math.inf
    ln_p_ref = lp.gather(1, tokens[:, None].long())[:, 0]
    ln_p_cand = lq.gather(1, tokens[:, None].long())[:, 0]
    return {
        "kl": kl,
        "top1_same": a.argmax(-1) == b.argmax(-1),
        "p_ref": ln_p_ref.exp(),
        "p_cand": ln_p_cand.exp(),
        "ref_nll": -ln_p_ref,
        "cand_nll": -ln_p_cand,
    }


def _check_against_reference(ref, cand, tokens, chunk_rows=64) -> dict:
    out = kld_statistics(ref, cand, tokens, chunk_rows=chunk_rows)
    got, want = out["per_position"], _reference(ref, cand, tokens)
    n = ref.shape[0]
    for key in want:
        assert got[key].shape == (n,), key
    assert got["kl"].dtype == torch.float64 and got["top1_same"].dtype == torch.bool
    assert torch.equal(torch.isinf(got["kl"]), torch.isinf(want["kl"]))
    finite = torch.isfinite(want["kl"])
    err = (got["kl"][finite] - want["kl"][finite]).abs()
    tol = KL_ATOL + KL_RTOL * want["kl"][finite]
    assert bool((err <= tol).all()), f"max KL error {float((err - tol).max()):.3g} over tolerance"
    assert bool((got["kl"] >= 0).all())
    assert torch.equal(got["top1_same"], want["top1_same"])
    for key in ("p_ref", "p_cand"):
        torch.testing.assert_close(got[key], want[key], rtol=2e-5, atol=1e-10)
    for key in ("ref_nll", "cand_nll"):
        torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=5e-6)
    return out


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize(
    ("n", "v", "chunk_rows", "noise"),
    [(37, 100, 16, 0.3), (130, 5000, 64, 0.02), (64, 5000, 64, 1e-3), (5, 5000, 64, 1.0), (1, 100, 7, 0.1)],
)
def test_matches_float64_reference(n, v, chunk_rows, noise):
    g = _gen(n * v)
    ref = torch.randn(n, v, generator=g) * 3
    cand = ref + noise * torch.randn(n, v, generator=g)
    tokens = torch.randint(0, v, (n,), generator=g)
    _check_against_reference(ref, cand, tokens, chunk_rows)


def test_extreme_logits():
    g = _gen(1)
    n, v = 24, 5000
    tokens = torch.randint(0, v, (n,), generator=g)
    # +-1e4 spreads: near one-hot rows, KL up to tens of nats
    ref = (torch.rand(n, v, generator=g) * 2 - 1) * 1e4
    _check_against_reference(ref, ref + 10 * torch.randn(n, v, generator=g), tokens, 5)
    # candidate spikes: KL in the thousands
    cand = ref.clone()
    cand[:, :50] += 2e4 * torch.rand(n, 50, generator=g)
    _check_against_reference(ref, cand, tokens, 5)
    # ties everywhere (small integers), and constant rows (uniform distributions, any offset)
    ties_a = torch.randint(-3, 3, (n, v), generator=g).float()
    ties_b = torch.randint(-3, 3, (n, v), generator=g).float()
    ties_b[:4] = ties_a[:4]
    ties_a[4:8], ties_b[4:8] = 0.0, 123.0
    out = _check_against_reference(ties_a, ties_b, tokens, 5)
    assert bool((out["per_position"]["kl"][:8] == 0).all())
    # one-hot-like rows: agree on half the rows, disagree on the others
    hot_a = torch.full((n, v), -30.0)
    hot_b = torch.full((n, v), -30.0)
    hot_a[torch.arange(n), torch.arange(n) * 7] = 30.0
    hot_b[torch.arange(n), torch.arange(n) * 7 + (torch.arange(n) % 2)] = 30.0
    out = _check_against_reference(hot_a, hot_b, tokens, 5)
    assert out["summary"]["same_top_pct"] == 50.0


def test_bf16_inputs():
    g = _gen(2)
    n, v = 50, 5000
    ref = (torch.randn(n, v, generator=g) * 3).bfloat16()
    cand = (ref.float() + 0.05 * torch.randn(n, v, generator=g)).bfloat16()
    tokens = torch.randint(0, v, (n,), generator=g, dtype=torch.int32)
    out = _check_against_reference(ref, cand, tokens, 16)
    mixed = kld_statistics(ref.float(), cand, tokens, chunk_rows=16)  # float32 vs bf16: same numbers
    assert torch.equal(mixed["per_position"]["kl"], out["per_position"]["kl"])


def test_identical_inputs_give_exact_zero():
    g = _gen(3)
    n, v = 70, 5000
    logits = torch.randn(n, v, generator=g) * 4
    logits[:, ::5] = -math.inf  # masked entries: -inf on both sides
    tokens = torch.randint(0, v // 5, (n,), generator=g) * 5 + 1
    out = kld_statistics(logits, logits.clone(), tokens, chunk_rows=16)
    pp, s = out["per_position"], out["summary"]
    assert bool((pp["kl"] == 0.0).all())
    assert bool(pp["top1_same"].all()) and s["same_top_pct"] == 100.0 and s["same_top_pct_se"] == 0.0
    assert torch.equal(pp["p_ref"], pp["p_cand"]) and torch.equal(pp["ref_nll"], pp["cand_nll"])
    assert s["mean_kld"] == 0.0 and s["max_kld"] == 0.0 and s["min_kld"] == 0.0
    assert s["rms_dp"] == 0.0 and s["ppl_ratio"] == 1.0 and s["ln_ppl_ratio"] == 0.0
    bf16 = logits.bfloat16()
    assert bool((kld_statistics(bf16, bf16, tokens)["per_position"]["kl"] == 0.0).all())


def test_chunk_rows_changes_nothing():
    g = _gen(4)
    n, v = 53, 5000
    ref = torch.randn(n, v, generator=g) * 3
    cand = ref + 0.1 * torch.randn(n, v, generator=g)
    cand[7, 11] = -math.inf  # one inf row and a slow-path row in the mix
    ref[9, ::2] = -math.inf
    tokens = torch.randint(0, v // 2, (n,), generator=g) * 2 + 1
    results = [kld_statistics(ref, cand, tokens, chunk_rows=c) for c in (1, 7, 16, 64, 1000)]
    first = results[0]["per_position"]
    for other in results[1:]:
        for key, value in other["per_position"].items():
            if value.dtype == torch.float64:
                assert torch.equal(value.view(torch.int64), first[key].view(torch.int64)), key
            else:
                assert torch.equal(value, first[key]), key
        assert json.dumps(other["summary"]) == json.dumps(results[0]["summary"])


def test_inf_and_invalid_rows():
    g = _gen(5)
    n, v = 8, 100
    ref = torch.randn(n, v, generator=g) * 3
    cand = ref + 0.1 * torch.randn(n, v, generator=g)
    tokens = torch.full((n,), 3)
    cand[1, 10] = -math.inf  # candidate -inf on a reference-supported token: KL = inf
    ref[2, 20] = -math.inf  # reference -inf: contributes 0 whatever the candidate has
    ref[3, 30], cand[3, 30] = -math.inf, -math.inf  # both -inf: 0
    ref[4, 40], cand[4, 40] = -1000.0, -math.inf  # p underflows in float32 but is > 0: still inf
    ref[5, :50] = -math.inf  # half the vocabulary masked in the reference
    out = _check_against_reference(ref, cand, tokens, 3)
    kl = out["per_position"]["kl"]
    assert math.isinf(kl[1]) and math.isinf(kl[4])
    assert torch.isfinite(kl[[0, 2, 3, 5, 6, 7]]).all()
    s = out["summary"]
    assert s["infinite_kld"] == 2 and s["mean_kld"] == math.inf and s["max_kld"] == math.inf
    assert math.isnan(s["mean_kld_se"]) and math.isfinite(s["median_kld"]) and s["min_kld"] >= 0
    json.dumps(s)  # inf / nan are Python floats (JSON "Infinity" / "NaN")

    for bad in (math.nan, math.inf):
        broken = ref.clone()
        broken[6, 7] = bad
        with pytest.raises(ValueError, match="reference logits at position 6"):
            kld_statistics(broken, cand, tokens)
        with pytest.raises(ValueError, match="candidate logits at position 6"):
            kld_statistics(ref, broken, tokens)
    masked = ref.clone()
    masked[0] = -math.inf
    with pytest.raises(ValueError, match="reference logits at position 0"):
        kld_statistics(masked, cand, tokens)


def test_validation():
    a = torch.zeros(4, 10)
    with pytest.raises(ValueError, match="differ in shape"):
        kld_statistics(a, torch.zeros(4, 11), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"next_tokens must be \[N=4\]"):
        kld_statistics(a, a, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="out of range"):
        kld_statistics(a, a, torch.full((4,), 10))
    with pytest.raises(ValueError, match="integer"):
        kld_statistics(a, a, torch.zeros(4))
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        kld_statistics(torch.zeros(10), torch.zeros(10), torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_rows"):
        kld_statistics(a, a, torch.zeros(4, dtype=torch.long), chunk_rows=0)


def test_percentiles_match_numpy_linear():
    rng = np.random.default_rng(0)
    fractions = [0.0, 0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 0.999, 1.0]
    for size in (1, 2, 3, 10, 2047):
        x = rng.lognormal(-6, 2, size)
        got = percentiles(x, fractions)
        want = np.percentile(x, [100 * f for f in fractions], method="linear")
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)
    assert percentiles([1.0, 2.0, 3.0, 4.0], [0.5]) == [2.5]  # llama.cpp's even-n median
    assert percentiles([0.0, 1.0, math.inf, math.inf], [0.9, 1.0]) == [math.inf, math.inf]
    with pytest.raises(ValueError):
        percentiles([], [0.5])


def test_summary_formulas():
    rng = np.random.default_rng(1)
    n = 2047
    kl = rng.lognormal(-6, 2, n)
    p_ref = rng.uniform(0, 1, n)
    p_cand = np.clip(p_ref + rng.normal(0, 0.05, n), 1e-9, 1)
    same = rng.uniform(size=n) < 0.93
    pp = {
        "kl": torch.from_numpy(kl),
        "top1_same": torch.from_numpy(same),
        "p_ref": torch.from_numpy(p_ref),
        "p_cand": torch.from_numpy(p_cand),
        "ref_nll": torch.from_numpy(-np.log(p_ref)),
        "cand_nll": torch.from_numpy(-np.log(p_cand)),
    }
    s = summarize(pp)
    assert s["positions"] == n
    assert all(isinstance(v, float) for k, v in s.items() if k not in ("positions", "infinite_kld"))
    json.dumps(s)
    close = pytest.approx
    assert s["mean_kld"] == close(kl.mean(), rel=1e-12)
    assert s["mean_kld_se"] == close(kl.std(ddof=1) / math.sqrt(n), rel=1e-12)
    # llama.cpp's form of the same SE: sqrt((Σx²/n - mean²) / (n - 1))
    assert s["mean_kld_se"] == close(math.sqrt(((kl**2).mean() - kl.mean() ** 2) / (n - 1)), rel=1e-9)
    assert (s["max_kld"], s["min_kld"]) == (kl.max(), kl.min())
    for key, f in KLD_PERCENTILES:
        name = "median_kld" if key == "median" else f"kld_{key}"
        assert s[name] == close(np.percentile(kl, 100 * f), rel=1e-12)
    top = same.mean()
    assert s["same_top_pct"] == close(100 * top) and s["same_top_pct_se"] == close(
        100 * math.sqrt(top * (1 - top) / n)
    )
    dp = p_cand - p_ref
    assert s["mean_dp"] == close(dp.mean()) and s["mean_dp_se"] == close(dp.std(ddof=1) / math.sqrt(n))
    assert s["rms_dp"] == close(math.sqrt((dp**2).mean()))
    assert s["rms_dp_se"] == close((dp**2).std(ddof=1) / math.sqrt(n) / (2 * s["rms_dp"]))
    for key, f in DP_PERCENTILES:
        name = "median_dp" if key == "median" else f"dp_{key}"
        assert s[name] == close(np.percentile(dp, 100 * f), rel=1e-12, abs=1e-15)
    assert (s["max_dp"], s["min_dp"]) == (dp.max(), dp.min())
    ref_nll, cand_nll = -np.log(p_ref), -np.log(p_cand)
    assert s["ppl_ref"] == close(math.exp(ref_nll.mean()))
    assert s["ppl_cand"] == close(math.exp(cand_nll.mean()))
    assert s["ppl_ratio"] == close(s["ppl_cand"] / s["ppl_ref"])
    assert s["ln_ppl_ratio"] == close((cand_nll - ref_nll).mean())
    assert s["ln_ppl_ratio_se"] == close((cand_nll - ref_nll).std(ddof=1) / math.sqrt(n))
    assert s["ppl_ratio_se"] == close(s["ppl_ratio"] * s["ln_ppl_ratio_se"])

    one = summarize({k: v[:1] for k, v in pp.items()})
    assert one["positions"] == 1 and math.isnan(one["mean_kld_se"])
    with pytest.raises(ValueError, match="lacks"):
        summarize({"kl": pp["kl"]})
