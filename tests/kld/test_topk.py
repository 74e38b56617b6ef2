"""The top-k + tail reference: exact at k = V, a bound that holds elsewhere, kld_statistics' conventions."""

from __future__ import annotations

import math

import pytest
import torch
from mixquant.kld.stats import kld_statistics
from mixquant.kld.topk import (
    REDUCED_KEYS,
    full_reference_bytes,
    kld_statistics_topk,
    reduce_reference,
    reference_bytes,
)

EXACT_KEYS = ("top1_same", "p_ref", "p_cand", "ref_nll", "cand_nll")


def _pair(n: int, v: int, *, scale: float, noise: float, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    ref = torch.randn(n, v, generator=g) * scale
    cand = ref + noise * torch.randn(n, v, generator=g)
    tokens = torch.randint(0, v, (n,), generator=g)
    return ref, cand, tokens


def _peaked(n: int, v: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Language-model-like rows: Zipf-shaped logits over a random permutation, sharpened, plus noise."""
    g = torch.Generator().manual_seed(seed)
    base = -torch.log(torch.arange(1, v + 1, dtype=torch.float32)) * 2.5  # p ~ rank^-2.5
    ref = torch.stack([base[torch.randperm(v, generator=g)] for _ in range(n)]) / 0.7
    cand = ref + 0.05 * torch.randn(n, v, generator=g)
    tokens = torch.randint(0, v, (n,), generator=g)
    return ref, cand, tokens


def _both(ref, cand, tokens, k, chunk_rows=64):
    reduced = reduce_reference(ref, tokens, k, chunk_rows=chunk_rows)
    return reduced, kld_statistics_topk(reduced, cand, tokens, chunk_rows=chunk_rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("v", [37, 512])
def test_k_equal_to_vocabulary_is_kld_statistics_bit_for_bit(v, dtype):
    ref, cand, tokens = _pair(41, v, scale=3.0, noise=0.3, seed=v)
    ref, cand = ref.to(dtype), cand.to(dtype)
    want = kld_statistics(ref, cand, tokens, chunk_rows=16)["per_position"]
    reduced, out = _both(ref, cand, tokens, v, chunk_rows=16)
    got = out["per_position"]
    for key in ("kl", "kl_low", "kl_high"):
        assert torch.equal(got[key], want["kl"]), key
    for key in EXACT_KEYS:
        assert torch.equal(got[key], want[key]), key
    assert bool((reduced["tail_mass"] == 0).all()) and bool((reduced["tail_plogp"] == 0).all())
    assert out["summary"]["max_kl_bound_width"] == 0.0
    assert out["summary"]["mean_kld"] == out["summary"]["mean_kld_low"] == out["summary"]["mean_kld_high"]


@pytest.mark.parametrize("make", ["random", "peaked"])
def test_exact_kl_lies_in_the_bound_and_the_bound_narrows_with_k(make):
    ref, cand, tokens = (
        _pair(96, 512, scale=3.0, noise=0.3, seed=1) if make == "random" else _peaked(96, 512, seed=2)
    )
    exact = kld_statistics(ref, cand, tokens)["per_position"]
    widths = []
    for k in (1, 8, 64):
        _, out = _both(ref, cand, tokens, k)
        pp = out["per_position"]
        low, high, point = pp["kl_low"], pp["kl_high"], pp["kl"]
        slack = 1e-10 + 1e-9 * exact["kl"]  # the two sides' float64 rounding, not the bound
        assert bool((low <= exact["kl"] + slack).all()), k
        assert bool((exact["kl"] <= high + slack).all()), k
        assert bool(((low <= point) & (point <= high)).all()), k
        assert bool((high > low).any()), k  # the tail is not empty: the bound has width
        for key in EXACT_KEYS:
            assert torch.equal(pp[key], exact[key]), (k, key)
        s = out["summary"]
        assert s["mean_kld_low"] <= s["mean_kld"] <= s["mean_kld_high"]
        assert s["max_kl_bound_width"] == pytest.approx(float((high - low).max()), rel=0, abs=0)
        widths.append(high - low)
    for narrow, wide in zip(widths[1:], widths[:-1], strict=True):
        assert bool((narrow <= wide * (1 + 1e-9) + 1e-15).all())
        assert float(narrow.mean()) < float(wide.mean())


def test_peaked_reference_gives_a_tight_point_estimate():
    ref, cand, tokens = _peaked(64, 512, seed=3)
    exact = kld_statistics(ref, cand, tokens)["summary"]["mean_kld"]
    _, out = _both(ref, cand, tokens, 64)
    s = out["summary"]
    assert abs(s["mean_kld"] - exact) < 0.05 * exact
    assert s["mean_kld_high"] - s["mean_kld_low"] < exact  # the bound is informative, not vacuous


def test_reduced_reference_holds_the_documented_values():
    ref, _, tokens = _peaked(20, 300, seed=4)
    k = 16
    reduced = reduce_reference(ref, tokens, k)
    assert {name: (t.dtype, t.shape) for name, t in reduced.items()} == {
        name: (dtype, (20, k) if shape == "k" else (20,)) for name, (dtype, shape) in REDUCED_KEYS.items()
    }
    lp64 = torch.log_softmax(ref.double(), dim=-1)
    order = torch.sort(ref, dim=1, descending=True, stable=True).indices[:, :k]
    assert torch.equal(reduced["top_ids"].long(), order)
    ln_p = reduced["top_logp"].double() - reduced["log_norm"][:, None]
    assert torch.allclose(ln_p, lp64.gather(1, order), rtol=0, atol=2e-6)
    tail = torch.ones_like(ref, dtype=torch.bool).scatter_(1, order, False)
    p64 = lp64.exp()
    want_mass = torch.where(tail, p64, 0.0).sum(1)
    want_plogp = torch.where(tail, p64 * lp64, 0.0).sum(1)
    assert torch.allclose(reduced["tail_mass"], want_mass, rtol=1e-5, atol=0)
    assert torch.allclose(reduced["tail_plogp"], want_plogp, rtol=1e-5, atol=0)
    assert torch.allclose(reduced["next_logp"], lp64.gather(1, tokens[:, None])[:, 0], rtol=0, atol=2e-6)


def test_tiny_tail_mass_is_summed_not_cancelled():
    ref = torch.full((2, 6), -60.0)
    ref[:, 0] = 0.0  # tail probability e^-60 ~ 8.8e-27 each: 1 - p_top is exactly 0 in float64
    reduced = reduce_reference(ref, torch.zeros(2, dtype=torch.long), 1)
    assert reduced["tail_mass"].tolist() == pytest.approx([5 * math.exp(-60.0)] * 2, rel=1e-6)
    assert reduced["tail_plogp"].tolist() == pytest.approx([5 * math.exp(-60.0) * -60.0] * 2, rel=1e-6)


def test_ties_go_to_the_lowest_id_and_the_first_is_the_argmax():
    ref = torch.tensor([[1.0, 5.0, 5.0, 2.0, 5.0], [0.0, 0.0, 0.0, 0.0, 0.0], [3.0, 1.0, 3.0, 3.0, -1.0]])
    reduced = reduce_reference(ref, torch.zeros(3, dtype=torch.long), 2)
    assert reduced["top_ids"].tolist() == [[1, 2], [0, 1], [0, 2]]
    assert torch.equal(reduced["top_ids"][:, 0].long(), ref.argmax(dim=1))


def test_chunk_rows_do_not_change_any_value():
    ref, cand, tokens = _pair(50, 97, scale=3.0, noise=0.2, seed=5)
    first_reduced, first = _both(ref, cand, tokens, 8, chunk_rows=1)
    for rows in (7, 64):
        reduced, out = _both(ref, cand, tokens, 8, chunk_rows=rows)
        for name in REDUCED_KEYS:
            assert torch.equal(reduced[name], first_reduced[name]), (rows, name)
        for key, value in out["per_position"].items():
            assert torch.equal(value, first["per_position"][key]), (rows, key)


def test_minus_inf_conventions():
    v = 8
    ref = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0]]).repeat(5, 1)
    cand = ref.clone()
    ref[0, 5:] = -math.inf  # reference -inf in the tail: contributes nothing, but only its mass is kept,
    cand[0, 5:] = -math.inf  # so the candidate's -inf there leaves the upper bound open
    cand[1, 1] = -math.inf  # candidate -inf on a top-k token: inf
    cand[2, 6] = -math.inf  # candidate -inf in a tail with mass: only the upper bound is inf
    cand[3, 2:] = -math.inf  # candidate -inf on the whole tail: inf
    ref[4, 1:] = -math.inf  # tail of mass 0: nothing to bound, KL = -ln q(token 0) exactly
    cand[4, 3] = -math.inf
    tokens = torch.zeros(5, dtype=torch.long)
    _, out = _both(ref, cand, tokens, 2)
    pp = out["per_position"]
    exact = kld_statistics(ref, cand, tokens)["per_position"]["kl"]
    for value in (pp["kl"][0], pp["kl_low"][0], exact[0]):
        assert float(value) == pytest.approx(0.0, abs=1e-12)
    assert math.isinf(float(pp["kl_high"][0]))
    assert [math.isinf(float(pp[key][1])) for key in ("kl", "kl_low", "kl_high")] == [True] * 3
    assert math.isfinite(float(pp["kl"][2])) and math.isfinite(float(pp["kl_low"][2]))
    assert math.isinf(float(pp["kl_high"][2])) and math.isinf(float(exact[2]))
    assert [math.isinf(float(pp[key][3])) for key in ("kl", "kl_low", "kl_high")] == [True] * 3
    assert pp["kl"][4] == pp["kl_low"][4] == pp["kl_high"][4] == pytest.approx(float(exact[4]), rel=1e-12)
    assert float(exact[4]) > 0.1
    assert out["summary"]["infinite_kld"] == 2
    assert out["summary"]["max_kl_bound_width"] == math.inf
    assert not any(bool(torch.isnan(pp[key]).any()) for key in pp)
    # k = V: the same inf pattern as kld_statistics, the same finite values
    _, full = _both(ref, cand, tokens, v)
    assert torch.equal(torch.isinf(full["per_position"]["kl"]), torch.isinf(exact))
    finite = torch.isfinite(exact)
    assert torch.allclose(full["per_position"]["kl"][finite], exact[finite], rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize(
    "row", [[0.0, math.nan, 1.0], [0.0, math.inf, 1.0], [-math.inf] * 3], ids=["nan", "inf", "all-minus-inf"]
)
def test_invalid_rows_raise_naming_the_position(row):
    ref = torch.zeros(3, 3)
    ref[1] = torch.tensor(row)
    with pytest.raises(ValueError, match="reference logits at position 1"):
        reduce_reference(ref, torch.zeros(3, dtype=torch.long), 2)
    reduced = reduce_reference(torch.zeros(3, 3), torch.zeros(3, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="candidate logits at position 1"):
        kld_statistics_topk(reduced, ref, torch.zeros(3, dtype=torch.long))


def test_bad_arguments_name_the_culprit():
    ref, cand, tokens = _pair(4, 10, scale=1.0, noise=0.1, seed=6)
    with pytest.raises(ValueError, match="top_k must be in"):
        reduce_reference(ref, tokens, 11)
    with pytest.raises(ValueError, match="top_k must be in"):
        reduce_reference(ref, tokens, 0)
    reduced = reduce_reference(ref, tokens, 3)
    with pytest.raises(ValueError, match="lacks \\['tail_mass'\\]"):
        kld_statistics_topk({k: t for k, t in reduced.items() if k != "tail_mass"}, cand, tokens)
    with pytest.raises(ValueError, match="reduced\\['top_ids'\\]"):
        kld_statistics_topk(reduced, cand[:3], tokens[:3])
    with pytest.raises(ValueError, match="next_tokens out of range"):
        kld_statistics_topk(reduced, cand, tokens + 10)


def test_storage_arithmetic_matches_what_is_kept():
    ref, _, tokens = _pair(9, 40, scale=1.0, noise=0.0, seed=7)
    reduced = reduce_reference(ref, tokens, 5)
    assert reference_bytes(9, 5) == sum(t.numel() * t.element_size() for t in reduced.values())
    assert full_reference_bytes(9, 40) == ref.numel() * ref.element_size()
    assert reference_bytes(250_000, 1024) == 250_000 * (1024 * 8 + 32) == 2_056_000_000
    assert full_reference_bytes(250_000, 131_072) == 131_072_000_000


@pytest.mark.parametrize("k", [1, 8, 64, 199])  # 199: a one-token tail, where the two lower bounds meet
def test_a_self_check_is_exactly_zero(k):
    ref, _, tokens = _peaked(30, 200, seed=8)
    _, out = _both(ref, ref.clone(), tokens, k)
    pp = out["per_position"]
    assert bool((pp["kl"] == 0.0).all()) and bool((pp["kl_low"] == 0.0).all())
    if k < 199:  # with more than one tail token the bound cannot know that the tails agree
        assert bool((pp["kl_high"] > 0.0).all())
    else:
        assert bool((pp["kl_high"] == 0.0).all())
    assert out["summary"]["mean_kld"] == 0.0


def test_a_candidate_tail_that_underflows_in_float32_stays_bounded():
    ref = torch.tensor([[0.0, -3.0, -3.5, -4.0, -2.0], [0.0, -1.0, -2.0, -3.0, -4.0]])
    cand = torch.tensor([[0.0, -120.0, -121.0, -119.0, -118.0], [0.0, -1.1, -2.0, -2.9, -4.2]])
    tokens = torch.tensor([0, 1])
    exact = kld_statistics(ref, cand, tokens)["per_position"]["kl"]
    _, out = _both(ref, cand, tokens, 1)
    pp = out["per_position"]
    assert bool(torch.isfinite(pp["kl_high"]).all())
    assert bool((pp["kl_low"] <= exact * (1 + 1e-9)).all()) and bool((exact <= pp["kl_high"]).all())
    assert float(pp["kl_low"][0]) > 0.9 * float(exact[0]) > 10.0  # the merged-tail bound, not 0
