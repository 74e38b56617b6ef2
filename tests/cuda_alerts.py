"""Which aten ops PyTorch refuses on CUDA under ``torch.use_deterministic_algorithms(True)``, and a
``TorchDispatchMode`` that records every op a piece of code runs -- on the CPU too -- and flags those.

The device stages run on CUDA with deterministic algorithms on (``mixquant.numerics.CUDA_PROFILE``), where
an op without a deterministic CUDA kernel raises. CI has no GPU, so the tests run the stages on the CPU
under :class:`OpRecorder` and judge each op as CUDA would. The rules are parsed from the docstring of
``torch.use_deterministic_algorithms`` itself (its "will throw a RuntimeError when mode=True" list), so a
PyTorch upgrade that lists a new op is picked up; an entry whose condition no clause below understands makes
:func:`throwing_rules` fail rather than be ignored. Beyond the doc, :func:`source_rules` adds what the CUDA
sources alert on but the list leaves out.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

THROWS_HEADING = r"will throw a\s+:class:`RuntimeError` when ``mode=True``:"
DETERMINISTIC_HEADING = r"will act\s+deterministically when ``mode=True``:"
# The arguments a rule looks at, shown in the recorded op signature: ``aten::put_.default(accumulate=False)``.
JUDGED_ARGUMENTS = ("reduce", "accumulate", "mode", "weights")
# aten's embedding_bag mode codes (``EmbeddingBag.cpp``: MODE_SUM, MODE_MEAN, MODE_MAX).
EMBEDDING_BAG_MODES = {"sum": 0, "mean": 1, "max": 2}


@functools.cache
def _schema(func: Any) -> tuple[str, str, tuple[str, ...], dict[str, Any]]:
    """(normalized op name, overload name, argument names, defaults) of an aten op overload."""
    arguments = func._schema.arguments
    defaults = {a.name: a.default_value for a in arguments if a.has_default_value()}
    return func._overloadpacket.__name__.strip("_"), func.name(), tuple(a.name for a in arguments), defaults


@dataclass(frozen=True)
class OpCall:
    """One aten op call: its normalized name (``_foo_backward_`` -> ``foo_backward``), the overload's full
    name, its arguments by schema name and its result."""

    op: str
    name: str
    args: dict[str, Any]
    out: Any

    @classmethod
    def of(cls, func: Any, args: tuple, kwargs: dict | None, out: Any) -> OpCall:
        op, name, names, defaults = _schema(func)
        named = dict(defaults)  # the dispatcher drops arguments left at their defaults
        named.update(zip(names, args, strict=False))
        named.update(kwargs or {})
        return cls(op, name, named, out)

    def signature(self) -> str:
        judged = []
        for name in JUDGED_ARGUMENTS:
            if name in self.args:
                value = self.args[name]
                judged.append(f"{name}={'<tensor>' if isinstance(value, torch.Tensor) else repr(value)}")
        return f"{self.name}({', '.join(judged)})"

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in tree_flatten(self.args)[0] if isinstance(t, torch.Tensor)]

    def out_dtype(self) -> torch.dtype | None:
        return next((t.dtype for t in tree_flatten(self.out)[0] if isinstance(t, torch.Tensor)), None)


Predicate = Callable[[OpCall], bool]


def _floating_output(call: OpCall) -> bool:
    dtype = call.out_dtype()
    return dtype is not None and (dtype.is_floating_point or dtype.is_complex)


# The condition clauses the throw list uses, each a pattern of the doc's words and the test of the op call
# it means. Calls are judged as if on CUDA, so "called on a CUDA tensor" always holds. This is also where the
# doc's exceptions live. What it lists as acting deterministically when the mode is on is either absent from
# the throw list -- ``torch.index_add`` "when called on CUDA tensor" (the eager experts' op; it runs
# ``index_put`` with accumulate there), ``torch.Tensor.index_put`` "with ``accumulate=False``" (and with
# ``accumulate=True``, listed for the CPU, on CUDA what index_add runs), ``scatter_add_`` "when called on a
# CUDA tensor", ``scatter`` "when `src` type is Tensor", ``index_copy`` -- or on it only under a condition
# checked here: ``bincount`` throws only "when called on a CUDA tensor and ``weights`` tensor is given",
# ``cumsum`` only "when dtype is floating point or complex", ``median`` only "with indices output", and
# ``scatter_reduce`` is deterministic "when ``reduce='sum'`` or ``reduce='mean'``" (see source_rules).
CLAUSES: tuple[tuple[str, Callable[[re.Match], Predicate]], ...] = (
    (r"when attempting to differentiate a CUDA tensor", lambda m: lambda call: "backward" in call.op),
    (r"called on (?:a )?CUDA tensor", lambda m: lambda call: True),
    (r"``accumulate=(True|False)``", lambda m: lambda call: call.args.get("accumulate") == (m[1] == "True")),
    (r"``weights``\s+tensor is given", lambda m: lambda call: call.args.get("weights") is not None),
    (r"with indices output", lambda m: lambda call: isinstance(call.out, tuple)),
    (r"when dtype is floating point or complex", lambda m: _floating_output),
    (r"``reduce='(\w+)'``", lambda m: lambda call: call.args.get("reduce") == m[1]),
    (r"called with a quantized tensor", lambda m: lambda call: any(t.is_quantized for t in call.tensors())),
    (r"``mode='(\w+)'``", lambda m: lambda call: call.args.get("mode") == EMBEDDING_BAG_MODES[m[1]]),
    # interpolate: the modes are sub-bullets naming the aten ops (see _aten_prefixes)
    (r"one of the following modes is used:", lambda m: lambda call: True),
)


@dataclass(frozen=True)
class Rule:
    """Calls of the aten ops named ``prefixes`` (normalized names starting with one) that meet every
    predicate throw on CUDA under deterministic algorithms; ``source`` says where the rule comes from."""

    source: str
    prefixes: tuple[str, ...]
    predicates: tuple[Predicate, ...]

    def flags(self, call: OpCall) -> bool:
        return call.op.startswith(self.prefixes) and all(predicate(call) for predicate in self.predicates)


def doc_entries(heading: str, doc: str | None = None) -> list[tuple[str, str, list[str]]]:
    """``(api, condition, sub-bullets)`` of the bullet list after ``heading`` in the docstring of
    ``torch.use_deterministic_algorithms`` (or ``doc``), e.g. ``("torch.bincount", "when called on a CUDA
    tensor and ``weights`` tensor is given", [])``."""
    text = inspect.cleandoc(doc if doc is not None else torch.use_deterministic_algorithms.__doc__)
    heading_match = re.search(heading, text)
    if heading_match is None:
        raise ValueError(f"torch.use_deterministic_algorithms.__doc__ has no list headed {heading!r}")
    block = re.split(r"\n(?=\S)", text[heading_match.end() :], maxsplit=1)[0]  # to the next paragraph
    items: list[list] = []
    for line in block.splitlines():
        line = line.strip()
        if line.startswith("* "):
            items.append([line[2:], []])
        elif line.startswith("- "):
            items[-1][1].append(line[2:].strip("`"))
        elif line:
            items[-1][0] += " " + line
    entries = []
    for item, subs in items:
        match = re.fullmatch(r":(?:class|func):`(?P<api>[^`]+)`\s*(?P<condition>.*)", item)
        if match is None:
            raise ValueError(f"torch.use_deterministic_algorithms.__doc__: cannot read the entry {item!r}")
        entries.append((match["api"], match["condition"], subs))
    return entries


@functools.cache
def aten_op_names() -> frozenset[str]:
    """Every registered aten op, normalized as :class:`OpCall` names them."""
    return frozenset(
        name.split("::", 1)[1].split(".", 1)[0].strip("_")
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("aten::")
    )


def _aten_prefixes(api: str, subs: list[str]) -> tuple[str, ...]:
    """The normalized aten op names an API of the doc reaches: ``torch.nn.AvgPool3d`` -> ``avg_pool3d``
    (its backward: ``avg_pool3d_backward``), ``torch.Tensor.put_`` -> ``put``; ``interpolate`` with the
    modes in its sub-bullets -> ``upsample_<mode>`` (aten's ``upsample_bilinear2d`` ...). A rank aten has
    no op of its own runs through another rank's (``MaxUnpool1d`` is aten ``max_unpool2d``): the name
    without its ``<N>d``."""
    name = api.rsplit(".", 1)[-1]
    name = re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower().strip("_")
    if name == "interpolate":
        return tuple(f"upsample_{mode}" for mode in subs)
    if name not in aten_op_names():
        name = re.sub(r"\dd$", "", name)
    return (name,)


def _predicates(api: str, condition: str) -> tuple[Predicate, ...]:
    predicates, rest = [], condition
    for pattern, make in CLAUSES:
        for match in re.finditer(pattern, condition):
            predicates.append(make(match))
        rest = re.sub(pattern, " ", rest)
    if re.sub(r"\b(?:when|and)\b|[\s,.:]", "", rest):
        raise ValueError(f"{api}: condition {condition!r} has words no clause of CLAUSES explains: {rest!r}")
    return tuple(predicates)


def throwing_rules(doc: str | None = None) -> list[Rule]:
    """One rule per entry of the doc's "will throw a RuntimeError when mode=True" list."""
    return [
        Rule(f"doc: {api} {condition}".strip(), _aten_prefixes(api, subs), _predicates(api, condition))
        for api, condition, subs in doc_entries(THROWS_HEADING, doc)
    ]


def deterministic_scatter_reduces(doc: str | None = None) -> frozenset[str]:
    """The ``reduce`` values the doc lists ``scatter_reduce`` as deterministic with on CUDA."""
    return frozenset(
        reduce
        for api, condition, _ in doc_entries(DETERMINISTIC_HEADING, doc)
        if api.endswith(".scatter_reduce")
        for reduce in re.findall(r"``reduce='(\w+)'``", condition)
    )


def source_rules(doc: str | None = None) -> list[Rule]:
    """What CUDA alerts on beyond the doc's list.

    * ``scatter_reduce`` with any reduce the doc does not list as deterministic: the list names only
      'prod', but ``scatter_reduce_two_cuda_kernel`` (ATen/native/cuda/ScatterGatherKernel.cu) calls
      ``alertNotDeterministic("scatter_reduce_cuda")`` for every reduce; only 'sum' and 'mean' avoid it,
      sent to ``index_put_`` with accumulate by ``scatter_reduce_two`` (TensorAdvancedIndexing.cpp) when
      deterministic algorithms are on.
    * ``index_reduce``: ``index_reduce_func_cuda_impl`` (ATen/native/cuda/Indexing.cu) calls
      ``alertNotDeterministic("index_reduce_cuda")`` for every reduce, and neither list names it.
    """
    allowed = deterministic_scatter_reduces(doc)
    return [
        Rule(
            f"ScatterGatherKernel.cu: scatter_reduce with reduce not in {sorted(allowed)}",
            ("scatter_reduce",),
            (lambda call: call.args.get("reduce") not in allowed,),
        ),
        Rule("Indexing.cu: index_reduce", ("index_reduce",), ()),
    ]


def cuda_alert_rules(doc: str | None = None) -> list[Rule]:
    return throwing_rules(doc) + source_rules(doc)


class OpRecorder(TorchDispatchMode):
    """Records every aten op run under it (this thread; any device) by signature, with the rule of each
    signature PyTorch would refuse on CUDA under deterministic algorithms."""

    def __init__(self, rules: list[Rule] | None = None):
        super().__init__()
        self.rules = rules if rules is not None else cuda_alert_rules()
        self.ops: Counter[str] = Counter()  # op signature -> calls
        self.alerts: dict[str, str] = {}  # op signature -> the source of the rule flagging it

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        call = OpCall.of(func, args, kwargs, out)
        signature = call.signature()
        self.ops[signature] += 1
        if signature not in self.alerts:
            for rule in self.rules:
                if rule.flags(call):
                    self.alerts[signature] = rule.source
                    break
        return out

    def seen(self, op: str) -> bool:
        """Whether an overload of ``op`` (``"aten::index_add_"``) ran."""
        return any(signature.startswith((op + ".", op + "(")) for signature in self.ops)


@contextlib.contextmanager
def recording(rules: list[Rule] | None = None) -> Iterator[OpRecorder]:
    """An :class:`OpRecorder` over the block, with deterministic algorithms on as the CUDA profile sets
    them (so what also alerts on the CPU raises here); the previous setting is restored after."""
    previous = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(True)
    try:
        with OpRecorder(rules) as recorder:
            yield recorder
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
