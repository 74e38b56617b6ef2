"""The KL CDF per evaluation domain: a panel per candidate, a curve per domain, deterministic PNG bytes."""

from __future__ import annotations

import math
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from mixquant.kld.plots import plot_kl_cdf_by_domain

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
DOMAINS = np.repeat(np.array(["docs", "code", "chat"]), [300, 200, 100])


def _kl(seed: int, n: int = DOMAINS.size) -> np.ndarray:
    return np.exp(np.random.default_rng(seed).normal(size=n) * 1.5) * 1e-2


def _size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left beside it
    return struct.unpack(">II", data[16:24])


def test_domain_cdf_is_a_png_and_equal_inputs_give_equal_bytes(tmp_path):
    with_zeros = _kl(1)
    with_zeros[:50] = 0.0
    with_inf = _kl(2)
    with_inf[400] = math.inf
    curves = {"searched": with_zeros, "uniform-nvfp4": torch.from_numpy(_kl(3)), "broken": with_inf}
    a = plot_kl_cdf_by_domain(curves, DOMAINS, tmp_path / "a" / "cdf.png", title="per domain")
    b = plot_kl_cdf_by_domain(dict(curves), DOMAINS.copy(), tmp_path / "b" / "cdf.png", title="per domain")
    assert a == tmp_path / "a" / "cdf.png"
    width, height = _size(a)
    assert width > 2 * height  # three candidate panels side by side
    assert a.read_bytes() == b.read_bytes()
    assert b"Software" not in a.read_bytes()
    other = plot_kl_cdf_by_domain(
        {**curves, "broken": _kl(4)}, DOMAINS, tmp_path / "c" / "cdf.png", title="x"
    )
    assert other.read_bytes() != a.read_bytes()  # the bytes follow the data

    # four candidates wrap onto a second row; a self-check with no positive KL draws on a linear axis
    grid = {f"c{i}": _kl(i) for i in range(4)}
    width4, height4 = _size(plot_kl_cdf_by_domain(grid, DOMAINS, tmp_path / "d" / "cdf.png", title="grid"))
    assert height4 > 1.5 * height
    zeros = {"bf16": np.zeros(DOMAINS.size)}
    _size(plot_kl_cdf_by_domain(zeros, DOMAINS, tmp_path / "e" / "cdf.png", title="self-check"))


def test_domain_cdf_refuses_a_length_mismatch_and_nan(tmp_path):
    with pytest.raises(ValueError, match="'searched' has 599 positions but position_domains names 600"):
        plot_kl_cdf_by_domain({"searched": _kl(1)[:-1]}, DOMAINS, tmp_path / "a.png", title="x")
    with pytest.raises(ValueError, match="one name per position"):
        plot_kl_cdf_by_domain({"searched": _kl(1)}, DOMAINS.reshape(2, -1), tmp_path / "b.png", title="x")
    broken = _kl(1)
    broken[3] = math.nan
    with pytest.raises(ValueError, match="has NaN"):
        plot_kl_cdf_by_domain({"searched": broken}, DOMAINS, tmp_path / "c.png", title="x")
    with pytest.raises(ValueError, match="no curves"):
        plot_kl_cdf_by_domain({}, DOMAINS, tmp_path / "d.png", title="x")
    assert not any(tmp_path.iterdir())  # nothing written
