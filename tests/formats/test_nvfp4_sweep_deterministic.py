"""The NVFP4 sweep picks its winners without an op CUDA refuses under deterministic algorithms, and picks
the same ones as before: the first-minimum selection equals the scatter_reduce("amin") formulation it
replaces, bit for bit, and the whole chunk sweep equals a dense argmin over all 126 candidates."""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path

import pytest
import torch

warnings.filterwarnings("ignore", message="transformers .* is not tested")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cuda_alerts import OpRecorder, recording  # noqa: E402
from mixquant.formats.nvfp4 import (  # noqa: E402
    BLOCK_SIZE,
    _first_minimum,
    _sq_err,
    _sweep_chunk,
    fp8_sweep_candidates,
    sweep_nvfp4_block_amax,
)

N_CANDIDATES = 126


def scatter_min_first(rows, cols, loss, n_blocks: int) -> torch.Tensor:
    """The selection the sweep used before: two scatter_reduce("amin") (no deterministic CUDA kernel)."""
    best_loss = torch.full((n_blocks,), math.inf).scatter_reduce_(0, rows, loss, "amin")
    is_best = loss == best_loss.index_select(0, rows)
    best = torch.full((n_blocks,), N_CANDIDATES, dtype=torch.long)
    return best.scatter_reduce_(0, rows[is_best], cols[is_best], "amin")


def survivors(counts: list[int], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-major ``(rows, cols)`` with ``counts[b]`` distinct ascending candidates in block b."""
    cols = [torch.randperm(N_CANDIDATES, generator=gen)[:count].sort().values for count in counts]
    rows = [torch.full((count,), b, dtype=torch.long) for b, count in enumerate(counts)]
    return torch.cat(rows), torch.cat(cols)


def random_case(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Blocks of 1..126 survivors whose losses come from a small pool (ties within a block), with zeros,
    infinities and subnormals among them, or are all distinct."""
    gen = torch.Generator().manual_seed(seed)
    n_blocks = int(torch.randint(1, 40, (1,), generator=gen))
    counts = [int(c) for c in torch.randint(1, N_CANDIDATES + 1, (n_blocks,), generator=gen)]
    counts[int(torch.randint(n_blocks, (1,), generator=gen))] = 1
    rows, cols = survivors(counts, gen)
    pool = torch.tensor([0.0, 1e-40, 3e-3, 3e-3, 0.5, 7.25, math.inf])
    if seed % 3 == 0:
        loss = torch.rand(rows.numel(), generator=gen)
    else:
        loss = pool[torch.randint(len(pool), (rows.numel(),), generator=gen)]
    return rows, cols, loss, n_blocks


@pytest.mark.parametrize("seed", range(60))
def test_first_minimum_equals_the_scatter_min_formulation_on_random_survivors(seed):
    rows, cols, loss, n_blocks = random_case(seed)
    assert torch.equal(
        _first_minimum(rows, cols, loss, n_blocks), scatter_min_first(rows, cols, loss, n_blocks)
    )


ADVERSARIAL = {
    "one block, every candidate ties": ([N_CANDIDATES], lambda n: torch.full((n,), 0.25)),
    "every loss infinite": ([N_CANDIDATES, 3, 1], lambda n: torch.full((n,), math.inf)),
    "one survivor per block": ([1] * 7, lambda n: torch.arange(n, 0, -1, dtype=torch.float32)),
    "zero loss at several candidates": ([5, 5], lambda n: torch.tensor([0.1, 0.0, 0.2, 0.0, 0.0] * 2)),
    "minimum at the last candidate": ([4, 9], lambda n: torch.arange(n, 0, -1, dtype=torch.float32)),
    "+0 and -0 tie": ([4], lambda n: torch.tensor([1.0, -0.0, 0.0, 2.0])),
    "finite beside infinite": ([3, 3], lambda n: torch.tensor([math.inf, 2.0, math.inf, 5.0, math.inf, 5.0])),
}


@pytest.mark.parametrize("name", ADVERSARIAL)
def test_first_minimum_equals_the_scatter_min_formulation_on_adversarial_survivors(name):
    counts, make_loss = ADVERSARIAL[name]
    rows, cols = survivors(counts, torch.Generator().manual_seed(0))
    loss = make_loss(rows.numel())
    expected = scatter_min_first(rows, cols, loss, len(counts))
    assert torch.equal(_first_minimum(rows, cols, loss, len(counts)), expected)


def adversarial_blocks() -> torch.Tensor:
    """[B, 16] magnitudes: Gaussian blocks with ties, all-zero, tiny and single-element blocks, blocks
    every candidate quantizes exactly, and huge ones whose losses overflow to inf for every candidate."""
    gen = torch.Generator().manual_seed(1)
    absx = (torch.randn(64, BLOCK_SIZE, generator=gen) * 0.02).abs()
    absx[1] = 0.0
    absx[2] = 1e-30
    absx[3] = 0.0
    absx[3, 7] = 0.3
    absx[4] = 0.01  # all elements equal
    absx[5] = torch.tensor([6.0, 4.0, 3.0, 2.0, 1.5, 1.0, 0.5, 0.0] * 2) / 16  # on the E2M1 grid
    absx[6] = 3e38
    absx[7, :8] = 3e38
    return absx


@pytest.mark.parametrize("global_amax", [0.1, 1.0, 3e38])
def test_the_chunk_sweep_equals_a_dense_argmin_over_every_candidate(global_amax):
    absx = adversarial_blocks()
    _, scales = fp8_sweep_candidates(torch.tensor(global_amax))
    dense = _sq_err(absx.unsqueeze(1), scales.view(1, -1, 1)).sum(dim=-1)  # [B, 126], the reference's losses
    assert torch.equal(_sweep_chunk(absx, scales), dense.argmin(dim=1))


def test_the_sweep_runs_no_op_cuda_refuses_under_deterministic_algorithms():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 256, generator=gen) * 0.02
    weight[0, :16] = 0.0
    weight[1, :] *= 40.0
    with recording() as recorder:
        amax = sweep_nvfp4_block_amax(weight.bfloat16(), chunk_rows=16)
    assert recorder.seen("aten::masked_scatter_") and recorder.seen("aten::nonzero"), recorder.ops
    assert recorder.alerts == {}
    assert torch.equal(amax, sweep_nvfp4_block_amax(weight.bfloat16()))


def test_the_recorder_would_catch_the_old_selection():
    rows, cols, loss, n_blocks = random_case(1)
    with OpRecorder() as recorder:
        scatter_min_first(rows, cols, loss, n_blocks)
    assert "aten::scatter_reduce_.two(reduce='amin')" in recorder.alerts
