"""Code identity of a stage's numerics: what of the code enters a key.

A stage names the library modules that decide its numbers (``StageSpec.numerics_modules``). Each
module enters the key as the SHA-256 of its *token stream* with everything cosmetic removed:
comments, blank lines and line breaks inside brackets, indentation width, and docstrings. So
rewording a comment or docstring, re-wrapping a call or running the formatter keeps every key
(no ten-GPU-hour rerun), while any change to a statement, a constant or an operator changes it.

Not covered on purpose: the rule scripts and Snakefile (thin glue; they pass config and paths
only) and logging/progress code outside the named modules. A change to numerics that lives
elsewhere (a new module) must be added to the stage's module list, and ``KEY_SCHEMA_VERSION``
bumps when the key layout itself changes.
"""

from __future__ import annotations

import ast
import importlib.util
import io
import tokenize
from functools import cache
from pathlib import Path

from mixquant.keys.hashing import bytes_sha256

_DROP = {tokenize.COMMENT, tokenize.NL, tokenize.ENCODING, tokenize.INDENT, tokenize.DEDENT}


def _docstring_starts(tree: ast.AST) -> set[tuple[int, int]]:
    starts = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = getattr(node, "body", [])
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                if isinstance(body[0].value.value, str):
                    starts.add((body[0].lineno, body[0].col_offset))
    return starts


def normalized_source(source: str) -> str:
    """The source's tokens without comments, docstrings and layout, one token per line.

    Indentation depth still matters (it is syntax): each logical line is prefixed with its depth.
    """
    tree = ast.parse(source)
    docstrings = _docstring_starts(tree)
    out: list[str] = []
    depth = 0
    skip_newline = False
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.INDENT:
            depth += 1
            continue
        if token.type == tokenize.DEDENT:
            depth -= 1
            continue
        if token.type in _DROP:
            continue
        if token.type == tokenize.STRING and token.start in docstrings:
            skip_newline = True
            continue
        if token.type == tokenize.NEWLINE:
            if skip_newline:
                skip_newline = False
                continue
            out.append("<NEWLINE>")
            continue
        if out and out[-1] == "<NEWLINE>" or not out:
            out.append(f"<DEPTH {depth}>")
        out.append(token.string)
    return "\n".join(out)


@cache
def module_identity(module: str) -> str:
    """SHA-256 of the normalized source of an importable module (found without importing it)."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        raise ValueError(f"code identity: module {module!r} has no Python source")
    return bytes_sha256(normalized_source(Path(spec.origin).read_text("utf-8")).encode("utf-8"))


def code_identity(modules: tuple[str, ...]) -> dict[str, str]:
    """{module: normalized-source SHA-256} for the modules that decide a stage's numerics."""
    return {module: module_identity(module) for module in sorted(modules)}
