#!/usr/bin/env python
"""Build a license-clean chat corpus from the running interpreter's own standard library.

The corpus is a JSONL file in post-training chat format, one conversation per line::

    {"messages": [{"content": "...", "role": "user"}, {"content": "...", "role": "assistant"}, ...]}

Content comes only from CPython's pure-Python standard library (module/class/function docstrings,
signatures and the source of short functions), which is distributed under the PSF License Agreement
for Python. The files are *parsed* with :mod:`ast` from ``sysconfig.get_paths()["stdlib"]``; no
module is ever imported (imports can have side effects).

Provenance rules (see ``_license_ok``):

* skipped trees: test suites, ``idlelib``, ``tkinter``, ``turtledemo``, ``lib2to3``, ``ensurepip``,
  ``site-packages``, generated data (``pydoc_data``, ``encodings``, ``_sysconfigdata*``), the deprecated
  ``distutils`` and jokes (``this``, ``antigravity``, ``__hello__``);
* skipped files: those whose header (everything before the first statement after the module docstring,
  plus ``__copyright__``/``__license__``) mentions any other licence text (MIT, Apache, BSD-style
  "Permission to use"/"Redistribution", "Python 1.6/2.2 license", ...) or a copyright holder other than
  the Python Software Foundation -- unless the header is a "Licensed to PSF under a Contributor
  Agreement" notice with no other licence text; a package whose ``__init__`` is skipped is skipped
  whole (e.g. ``re``, ``logging``, ``sqlite3``, ``tomllib``, ``unittest``, ``xml.etree``);
* the modules that the CPython licence page lists as incorporated third-party software (asynchat,
  asyncore, http.cookies, trace, uu, xmlrpc) are skipped by name.

``_pydecimal`` was checked: its header is "Copyright (c) 2004 Python Software Foundation", so it is kept.

Determinism: files are visited in sorted order and every per-item choice is drawn from a
``random.Random`` seeded with the item's qualified name, so re-running on the same Python gives a
byte-identical file (``--check`` verifies that against an existing output).

Usage::

    .venv/bin/python tools/make_corpus.py --out data/corpus/python-stdlib-chat.jsonl
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import inspect
import json
import random
import re
import sys
import sysconfig
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

MAX_CHARS = 3000
MAX_SOURCE_LINES = 40
MIN_DOC_CHARS = 40
KEEP_FUNCTION = 0.65  # fraction of public functions that yield conversations
KEEP_METHOD = 0.35  # fraction of public methods that yield conversations

SKIP_DIRS = {
    "test",
    "tests",
    "idlelib",
    "tkinter",
    "turtledemo",
    "lib2to3",
    "ensurepip",
    "site-packages",
    "dist-packages",
    "__pycache__",
    "lib-dynload",
    "pydoc_data",  # generated copy of the HTML docs, not docstrings
    "encodings",  # codec tables, CNRI headers
    "__phello__",
}
# Modules the CPython licence page lists under "Licenses and Acknowledgements for Incorporated Software",
# generated/machine-specific files, and jokes.
SKIP_MODULES = {
    "asynchat",
    "asyncore",
    "http.cookies",
    "trace",
    "uu",
    "xmlrpc",
    "this",
    "antigravity",
    "__hello__",
    "distutils",  # deprecated by PEP 632 and removed in 3.12
}

_OTHER_LICENSE = re.compile(
    r"apache license|mit license|spdx-license-identifier|permission to use|permission is hereby granted|"
    r"redistributions? of source|redistribution and use|python license|python \d\.\d+ license|"
    r"same terms as python|choose between two licenses|gnu general public|\bgpl\b",
    re.IGNORECASE,
)
_PSF_CONTRIB = re.compile(r"licensed to (the )?psf under a contributor agreement", re.IGNORECASE)
_COPYRIGHT = re.compile(r"copyright|\(c\)", re.IGNORECASE)
# Lines that mention copyright without being a notice (functools: "See C source code for _functools
# credits/copyright").
_NOT_A_NOTICE = re.compile(r"see c source code for", re.IGNORECASE)

SYSTEM_PROMPTS = [
    "You are a helpful assistant who knows the Python standard library well.",
    "You are a concise Python tutor. Answer with accurate details from the standard library.",
    "You are a senior Python engineer helping a colleague read library code.",
    "You answer questions about Python modules, functions and classes.",
]


@dataclass
class Func:
    module: str
    qualname: str  # e.g. "dumps" or "JSONEncoder.encode"
    signature: str  # as written, e.g. "dumps(obj, *, skipkeys=False)" or "encode(self, o)"
    call_signature: str  # without the bound self/cls argument: "encode(o)"
    doc: str | None
    source: str | None  # only for short functions
    is_method: bool
    is_async: bool

    @property
    def dotted(self) -> str:
        return f"{self.module}.{self.qualname}"


@dataclass
class Klass:
    module: str
    name: str
    bases: list[str]
    doc: str | None
    methods: list[Func] = field(default_factory=list)

    @property
    def dotted(self) -> str:
        return f"{self.module}.{self.name}"


@dataclass
class Module:
    name: str
    doc: str | None
    functions: list[Func]
    classes: list[Klass]


# ---------------------------------------------------------------------------------------------
# Discovery and parsing
# ---------------------------------------------------------------------------------------------


def module_name(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _header_text(text: str, tree: ast.Module) -> str:
    """Everything before the first statement that is not the module docstring, plus __copyright__."""
    body = tree.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    end = body[0].lineno - 1 if body else len(text.splitlines())
    lines = text.splitlines()[:end]
    extra = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            if any(n in ("__copyright__", "__license__") for n in names) and isinstance(
                node.value.value, str
            ):
                extra.append(node.value.value)
    return "\n".join(lines + extra)


def _license_ok(header: str) -> bool:
    if _OTHER_LICENSE.search(header):
        return False
    copyright_lines = [
        ln for ln in header.splitlines() if _COPYRIGHT.search(ln) and not _NOT_A_NOTICE.search(ln)
    ]
    if not copyright_lines:
        return True
    if _PSF_CONTRIB.search(header):
        return True
    return all("python software foundation" in ln.lower() for ln in copyright_lines)


def iter_stdlib_files(stdlib: Path) -> list[tuple[Path, str]]:
    out = []
    for path in sorted(stdlib.rglob("*.py"), key=lambda p: p.relative_to(stdlib).as_posix()):
        rel = path.relative_to(stdlib)
        if any(part in SKIP_DIRS or part.startswith("config-") for part in rel.parts[:-1]):
            continue
        if rel.name.startswith("_sysconfigdata") or rel.name in ("__phello__.py",):
            continue
        name = module_name(rel)
        if any(name == m or name.startswith(m + ".") for m in SKIP_MODULES):
            continue
        out.append((path, name))
    return out


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef, drop_self: bool) -> str:
    args = node.args
    if drop_self:
        args = ast.arguments(
            posonlyargs=list(args.posonlyargs),
            args=list(args.args),
            vararg=args.vararg,
            kwonlyargs=args.kwonlyargs,
            kw_defaults=args.kw_defaults,
            kwarg=args.kwarg,
            defaults=list(args.defaults),
        )
        if args.posonlyargs:
            args.posonlyargs.pop(0)
        elif args.args:
            args.args.pop(0)
    # Annotations are stripped: the stdlib mostly has none and they bloat signatures.
    for a in args.posonlyargs + args.args + args.kwonlyargs:
        a.annotation = None
    if args.vararg:
        args.vararg.annotation = None
    if args.kwarg:
        args.kwarg.annotation = None
    return f"{node.name}({ast.unparse(args)})"


def _clean(doc: str | None) -> str | None:
    if not doc:
        return None
    doc = inspect.cleandoc(doc).strip()
    return doc or None


def _is_public(name: str) -> bool:
    return not name.startswith("_")


def _source(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """Whole source lines of a function (decorators included), dedented; None unless short."""
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    seg = textwrap.dedent("\n".join(lines[first - 1 : node.end_lineno]))
    n = seg.count("\n") + 1
    if n > MAX_SOURCE_LINES or n < 3 or len(seg) > MAX_CHARS - 500:
        return None
    return seg.rstrip()


def _func(lines: list[str], node, module: str, owner: str | None, is_method: bool) -> Func:
    static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in node.decorator_list)
    return Func(
        module=module,
        qualname=f"{owner}.{node.name}" if owner else node.name,
        signature=_signature(node, drop_self=False),
        call_signature=_signature(node, drop_self=is_method and not static),
        doc=_clean(ast.get_docstring(node, clean=False)),
        source=_source(lines, node),
        is_method=is_method,
        is_async=isinstance(node, ast.AsyncFunctionDef),
    )


def parse_module(path: Path, name: str) -> Module | None:
    text = path.read_text(encoding="utf-8")
    try:
        tree = ast.parse(text, filename=str(path))
    except SyntaxError:
        return None
    if not _license_ok(_header_text(text, tree)):
        return None
    lines = text.splitlines()
    funcs: list[Func] = []
    classes: list[Klass] = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and _is_public(node.name):
            funcs.append(_func(lines, node, name, None, False))
        elif isinstance(node, ast.ClassDef) and _is_public(node.name):
            klass = Klass(
                module=name,
                name=node.name,
                bases=[ast.unparse(b) for b in node.bases],
                doc=_clean(ast.get_docstring(node, clean=False)),
            )
            for sub in node.body:
                if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef) and (
                    _is_public(sub.name) or sub.name == "__init__"
                ):
                    klass.methods.append(_func(lines, sub, name, node.name, True))
            classes.append(klass)
    return Module(
        name=name, doc=_clean(ast.get_docstring(tree, clean=False)), functions=funcs, classes=classes
    )


# ---------------------------------------------------------------------------------------------
# Text helpers
# ---------------------------------------------------------------------------------------------


def cap(text: str, limit: int = MAX_CHARS) -> str:
    """Cut text to at most `limit` characters, on a line boundary when possible."""
    if len(text) <= limit:
        return text
    cut = text.rfind("\n", 0, limit - 40)
    if cut < limit // 2:
        cut = limit - 40
    return text[:cut].rstrip() + "\n\n(The rest of this docstring is omitted for brevity.)"


def first_paragraph(doc: str) -> str:
    return doc.split("\n\n", 1)[0].strip()


def first_sentence(doc: str) -> str:
    para = " ".join(first_paragraph(doc).split())
    m = re.match(r"(.+?[.!?])(\s|$)", para)
    return (m.group(1) if m else para).strip()


def lower_first(s: str) -> str:
    return s[:1].lower() + s[1:] if s[:1].isupper() and not s[1:2].isupper() else s


def code_block(src: str) -> str:
    return f"```python\n{src}\n```"


def param_summary(sig: str) -> str | None:
    """Describe the parameters of a signature string like 'f(a, b=1, *args, c, **kw)'."""
    try:
        node = ast.parse(f"def {sig}: pass").body[0]
    except SyntaxError:
        return None
    a = node.args
    items: list[str] = []
    positional = a.posonlyargs + a.args
    n_no_default = len(positional) - len(a.defaults)
    for i, arg in enumerate(positional):
        if i < n_no_default:
            items.append(f"- `{arg.arg}`: required")
        else:
            items.append(
                f"- `{arg.arg}`: optional, defaults to `{ast.unparse(a.defaults[i - n_no_default])}`"
            )
        if arg in a.posonlyargs:
            items[-1] += " (positional-only)"
    if a.vararg:
        items.append(f"- `*{a.vararg.arg}`: any number of extra positional arguments")
    for arg, default in zip(a.kwonlyargs, a.kw_defaults, strict=True):
        if default is None:
            items.append(f"- `{arg.arg}`: keyword-only, required")
        else:
            items.append(f"- `{arg.arg}`: keyword-only, defaults to `{ast.unparse(default)}`")
    if a.kwarg:
        items.append(f"- `**{a.kwarg.arg}`: any extra keyword arguments")
    if not items:
        return "It takes no arguments."
    return "Parameters:\n" + "\n".join(items)


def msg(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": cap(content)}


# ---------------------------------------------------------------------------------------------
# Conversation templates
# ---------------------------------------------------------------------------------------------

ASK_DOC = [
    "What does `{name}` do?",
    "Can you explain `{name}`?",
    "I keep seeing `{name}` in code. What is it for?",
    "Explain what `{name}` does in Python.",
    "How does `{name}` behave?",
    "Quick question: what's the purpose of `{name}`?",
    "What is `{name}` in the Python standard library?",
    "Describe `{name}` for me, please.",
]
ASK_SIG = [
    "Show me the signature of `{name}`.",
    "What arguments does `{name}` take?",
    "How do I call `{name}`? What are its parameters?",
    "What's the parameter list of `{name}`?",
]
ASK_SRC = [
    "Write a function like `{name}` from the standard library.",
    "How is `{name}` implemented?",
    "Can you show me the source code of `{name}`?",
    "I want to understand `{name}`. Show me its implementation.",
    "Write `{short}` the way the `{module}` module does it.",
]
ASK_MOD = [
    "Explain the module `{name}`.",
    "What is the `{name}` module for?",
    "Give me an overview of Python's `{name}` module.",
    "What can I do with `{name}`?",
    "Tell me about the standard library module `{name}`.",
]
ASK_CLASS = [
    "What is the `{name}` class for?",
    "Explain the class `{name}`.",
    "What does `{name}` represent?",
    "How do I use the `{name}` class?",
]
ASK_METHODS = [
    "List the methods of `{name}`.",
    "What methods does `{name}` provide?",
    "Which public methods are defined on `{name}`?",
]
ASK_FIND = [
    "Is there a function in the Python standard library for this: {task}",
    "Which standard library function should I use? I need something that does this: {task}",
    "I'm looking for a stdlib helper. Its job: {task} What's it called?",
]
SUMMARY_LEADS = ["In one sentence:", "Its docstring sums it up:", "Summary:", "What it does:"]
FOLLOW_SRC = [
    "Can you show me how it is implemented?",
    "Thanks. What does its source look like?",
    "Show me the code.",
]
FOLLOW_SIG = [
    "What parameters does it accept?",
    "And how exactly do I call it?",
    "What's its signature?",
]
FOLLOW_MOD = [
    "Which module is it in, and what else does that module offer?",
    "What else is in the same module?",
]
FOLLOW_METHODS = [
    "What methods does it have?",
    "Which methods can I call on it?",
]


def _kind(f: Func) -> str:
    if f.is_method:
        return "async method" if f.is_async else "method"
    return "coroutine function" if f.is_async else "function"


def _def(f: Func) -> str:
    return f"{'async ' if f.is_async else ''}def {f.signature}"


def answer_doc(f: Func) -> str:
    return f"`{f.dotted}` is a {_kind(f)} in the `{f.module}` module.\n\n{_def_line(f)}\n\n{f.doc}"


def _def_line(f: Func) -> str:
    return code_block(_def(f))


def answer_sig(f: Func) -> str:
    parts = [f"The signature of `{f.dotted}` is:", code_block(_def(f))]
    ps = param_summary(f.call_signature)
    if ps:
        parts.append(ps)
    if f.doc:
        parts.append(f"In short: {first_paragraph(f.doc)}")
    return "\n\n".join(parts)


def answer_src(f: Func) -> str:
    intro = f"Here is the implementation of `{f.dotted}` from the `{f.module}` module:"
    outro = ""
    if f.doc:
        lead = _rng("src:" + f.dotted).choice(SUMMARY_LEADS)
        outro = f"\n\n{lead} {first_sentence(f.doc)}"
    return f"{intro}\n\n{code_block(f.source)}{outro}"


def module_listing(m: Module) -> str:
    out = []
    funcs = [f.qualname for f in m.functions]
    classes = [c.name for c in m.classes]
    if funcs:
        out.append(
            f"Public functions: {', '.join(f'`{n}`' for n in funcs[:25])}{' …' if len(funcs) > 25 else ''}."
        )
    if classes:
        out.append(
            f"Public classes: {', '.join(f'`{n}`' for n in classes[:25])}{' …' if len(classes) > 25 else ''}."
        )
    return "\n".join(out)


def answer_mod(m: Module) -> str:
    listing = module_listing(m)
    body = f"The `{m.name}` module, as its docstring puts it:\n\n{m.doc}"
    return cap(body, MAX_CHARS - len(listing) - 4) + (f"\n\n{listing}" if listing else "")


def answer_class(c: Klass) -> str:
    base = f" It derives from {', '.join(f'`{b}`' for b in c.bases)}." if c.bases else ""
    head = f"`{c.dotted}` is a class defined in the `{c.module}` module.{base}"
    init = next((m for m in c.methods if m.qualname.endswith(".__init__")), None)
    ctor = ""
    if init:
        params = init.call_signature.split("(", 1)[1]
        ctor = f"\n\nConstructor:\n\n{code_block(f'{c.name}({params}')}"
    return f"{head}{ctor}\n\n{c.doc}"


def answer_methods(c: Klass) -> str:
    lines = []
    for meth in c.methods:
        if meth.qualname.endswith(".__init__"):
            continue
        short = meth.call_signature
        desc = f": {first_sentence(meth.doc)}" if meth.doc else ""
        lines.append(f"- `{short}`{desc}")
    return f"`{c.dotted}` defines these public methods:\n\n" + "\n".join(lines)


def answer_where(f: Func, m: Module) -> str:
    others = [x.qualname for x in m.functions if x.qualname != f.qualname][:15]
    text = f"It lives in the `{m.name}` module."
    if m.doc:
        text += f" That module's summary: {first_sentence(m.doc)}"
    if others:
        text += f"\n\nOther public functions there include {', '.join(f'`{o}`' for o in others)}."
    if m.classes:
        text += f"\n\nIt also defines classes such as {', '.join(f'`{c.name}`' for c in m.classes[:10])}."
    return text


def _user(rng: random.Random, templates: list[str], **kw: str) -> str:
    return rng.choice(templates).format(**kw)


def _maybe_system(rng: random.Random, messages: list[dict]) -> list[dict]:
    if rng.random() < 0.15:
        return [msg("system", rng.choice(SYSTEM_PROMPTS))] + messages
    return messages


def _rng(key: str) -> random.Random:
    return random.Random(hashlib.sha256(key.encode()).hexdigest())


def function_conversations(f: Func, m: Module) -> list[list[dict]]:
    rng = _rng("func:" + f.dotted)
    # A fixed, per-item subsample keeps the file near 2 MB while touching every module.
    if rng.random() >= (KEEP_METHOD if f.is_method else KEEP_FUNCTION):
        return []
    convs: list[list[dict]] = []
    name = f.dotted
    has_doc = f.doc is not None and len(f.doc) >= MIN_DOC_CHARS
    if has_doc:
        r = rng.random()
        conv = [msg("user", _user(rng, ASK_DOC, name=name)), msg("assistant", answer_doc(f))]
        if r < 0.25 and f.source:
            conv += [msg("user", rng.choice(FOLLOW_SRC)), msg("assistant", answer_src(f))]
        elif r < 0.40:
            conv += [msg("user", rng.choice(FOLLOW_SIG)), msg("assistant", answer_sig(f))]
        elif r < 0.50 and not f.is_method:
            conv += [msg("user", rng.choice(FOLLOW_MOD)), msg("assistant", answer_where(f, m))]
        convs.append(conv)
    if f.is_method and not has_doc:
        return convs
    r = rng.random()
    if r < 0.35 and f.doc and (args := param_summary(f.call_signature)) and "no arguments" not in args:
        convs.append([msg("user", _user(rng, ASK_SIG, name=name)), msg("assistant", answer_sig(f))])
    if f.source and rng.random() < (0.75 if not f.is_method else 0.3):
        short = f.qualname.rsplit(".", 1)[-1]
        q = _user(rng, ASK_SRC, name=name, short=short, module=f.module)
        convs.append([msg("user", q), msg("assistant", answer_src(f))])
    if has_doc and not f.is_method and rng.random() < 0.2:
        task = first_sentence(f.doc)
        if 20 <= len(task) <= 200 and f.qualname.lower() not in task.lower():
            answer = f"Yes: `{name}` does that.\n\n{code_block(_def(f))}\n\n{first_paragraph(f.doc)}"
            convs.append([msg("user", _user(rng, ASK_FIND, task=task)), msg("assistant", answer)])
    return [_maybe_system(rng, c) for c in convs]


def class_conversations(c: Klass) -> list[list[dict]]:
    rng = _rng("class:" + c.dotted)
    convs: list[list[dict]] = []
    public = [m for m in c.methods if not m.qualname.endswith(".__init__")]
    if c.doc and len(c.doc) >= MIN_DOC_CHARS:
        conv = [msg("user", _user(rng, ASK_CLASS, name=c.dotted)), msg("assistant", answer_class(c))]
        if public and rng.random() < 0.4:
            conv += [msg("user", rng.choice(FOLLOW_METHODS)), msg("assistant", answer_methods(c))]
        convs.append(conv)
    elif len(public) >= 2:
        convs.append(
            [msg("user", _user(rng, ASK_METHODS, name=c.dotted)), msg("assistant", answer_methods(c))]
        )
    return [_maybe_system(rng, x) for x in convs]


def module_conversations(m: Module) -> list[list[dict]]:
    rng = _rng("module:" + m.name)
    if not m.doc or len(m.doc) < MIN_DOC_CHARS:
        return []
    return [
        _maybe_system(rng, [msg("user", _user(rng, ASK_MOD, name=m.name)), msg("assistant", answer_mod(m))])
    ]


def build(stdlib: Path) -> list[list[dict]]:
    parsed: list[Module] = []
    rejected_packages: list[str] = []
    for path, name in iter_stdlib_files(stdlib):
        m = parse_module(path, name)
        if m is not None:
            parsed.append(m)
        elif path.name == "__init__.py":  # a package's licence header covers the whole package
            rejected_packages.append(name)
    conversations: list[list[dict]] = []
    for m in parsed:
        if any(m.name.startswith(pkg + ".") for pkg in rejected_packages):
            continue
        conversations += module_conversations(m)
        for f in m.functions:
            conversations += function_conversations(f, m)
        for c in m.classes:
            conversations += class_conversations(c)
            for meth in c.methods:
                if not meth.qualname.endswith(".__init__"):
                    conversations += function_conversations(meth, m)
    return conversations


def render(conversations: list[list[dict]]) -> bytes:
    lines = [json.dumps({"messages": c}, ensure_ascii=False, sort_keys=True) for c in conversations]
    return ("\n".join(lines) + "\n").encode("utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--out", required=True, type=Path, help="output JSONL path")
    parser.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    parser.add_argument("--check", action="store_true", help="fail if --out differs from a fresh build")
    args = parser.parse_args(argv)

    data = render(build(args.stdlib))
    sha = hashlib.sha256(data).hexdigest()
    n = data.count(b"\n")
    if args.check:
        current = args.out.read_bytes()
        if current != data:
            old = hashlib.sha256(current).hexdigest()
            print(f"{args.out}: differs from a fresh build (sha256 {old} != {sha})")
            return 1
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_bytes(data)
    print(f"python {sys.version.split()[0]}  records {n}  bytes {len(data)}  sha256 {sha}  -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
