"""The CUDA determinism rules parsed from ``torch.use_deterministic_algorithms.__doc__`` and the op recorder
the device-stage tests judge with (tests/cuda_alerts.py): a plausible parse, the ops CUDA refuses flagged,
the ones the doc lists as deterministic under the mode not."""

from __future__ import annotations

import pytest
import torch
from cuda_alerts import (
    THROWS_HEADING,
    OpRecorder,
    aten_op_names,
    deterministic_scatter_reduces,
    doc_entries,
    recording,
    throwing_rules,
)


def test_the_throw_list_parses_into_rules_that_reach_aten_ops():
    apis = [api for api, _, _ in doc_entries(THROWS_HEADING)]
    assert 20 <= len(apis) <= 60, apis  # torch 2.13 lists 25
    assert {"torch.Tensor.scatter_reduce", "torch.bincount", "torch.cumsum", "torch.Tensor.put_"} <= set(apis)
    rules = throwing_rules()
    assert len(rules) == len(apis)
    for rule in rules:  # every API of the doc maps onto aten ops a recorder can see
        assert all(any(op.startswith(prefix) for op in aten_op_names()) for prefix in rule.prefixes), rule
    assert deterministic_scatter_reduces() == {"sum", "mean"}


def test_an_entry_no_clause_understands_fails_the_parse():
    doc = """The following normally-nondeterministic operations will throw a
    :class:`RuntimeError` when ``mode=True``:

        * :func:`torch.histc` when called on a CUDA tensor under a full moon

    Afterwards."""
    with pytest.raises(ValueError, match="under a full moon"):
        throwing_rules(doc)


def _src(n: int = 6) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32)


def _index() -> torch.Tensor:
    return torch.tensor([0, 1, 0, 2, 1, 0])


REFUSED = {
    "scatter_reduce amin (the old NVFP4 sweep)": lambda: torch.zeros(3).scatter_reduce_(
        0, _index(), _src(), "amin"
    ),
    "scatter_reduce amax": lambda: torch.zeros(3).scatter_reduce(0, _index(), _src(), "amax"),
    "scatter_reduce prod": lambda: torch.ones(3).scatter_reduce(0, _index(), _src(), "prod"),
    "index_reduce": lambda: torch.zeros(3).index_reduce_(0, _index(), _src(), "amin"),
    "bincount with weights": lambda: torch.bincount(_index(), weights=_src()),
    "float cumsum": lambda: _src().cumsum(0),
    "put_ without accumulate": lambda: torch.zeros(3).put_(_index(), _src(), accumulate=False),
    "put_ with accumulate": lambda: torch.zeros(3).put_(_index(), _src(), accumulate=True),
    "histc": lambda: torch.histc(_src(), bins=4),
    "median with indices": lambda: _src().view(2, 3).median(dim=1),
}

# The doc's "will act deterministically when mode=True" list (and the throw list's conditions).
DETERMINISTIC = {
    "index_add_ (the eager experts)": lambda: torch.zeros(3).index_add_(0, _index(), _src()),
    "index_put_ with accumulate": lambda: torch.zeros(3).index_put_((_index(),), _src(), accumulate=True),
    "index_put_ without accumulate": lambda: torch.zeros(3).index_put_((_index()[:3],), _src(3)),
    "scatter_add_": lambda: torch.zeros(3).scatter_add_(0, _index(), _src()),
    "scatter_ with a tensor src": lambda: torch.zeros(3).scatter_(0, _index()[:3], _src(3)),
    "index_copy_": lambda: torch.zeros(3).index_copy_(0, torch.tensor([2, 0, 1]), _src(3)),
    "scatter_reduce sum": lambda: torch.zeros(3).scatter_reduce(0, _index(), _src(), "sum"),
    "scatter_reduce mean": lambda: torch.zeros(3).scatter_reduce(0, _index(), _src(), "mean"),
    "bincount without weights": lambda: torch.bincount(_index(), minlength=3),
    "integer cumsum": lambda: _index().cumsum(0),
    "median without indices": lambda: _src().median(),
}


@pytest.mark.filterwarnings("ignore:index_reduce\\(\\) is in beta")
@pytest.mark.parametrize("name", REFUSED)
def test_the_recorder_flags_what_cuda_refuses(name):
    with OpRecorder() as recorder:  # deterministic mode off: put_ without accumulate alerts on the CPU too
        REFUSED[name]()
    assert recorder.alerts, recorder.ops


@pytest.mark.parametrize("name", DETERMINISTIC)
def test_the_recorder_passes_what_the_doc_lists_as_deterministic(name):
    with recording() as recorder:
        DETERMINISTIC[name]()
    assert recorder.ops, "the recorder saw no op"
    assert recorder.alerts == {}


def test_recording_restores_the_deterministic_setting():
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    with recording():
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
    assert (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    ) == before
