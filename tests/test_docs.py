"""The user-facing docs point only at what a user of the repository has: every relative link and every
repository path they name resolves inside the repository, and none names a file outside it or a
tracker's issue number."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TRACKED = subprocess.run(
    ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
).stdout.splitlines()
DOCS = sorted(name for name in TRACKED if name.endswith(".md"))
# Top-level directories of the repository: a backticked path starting with one is a claim about the tree.
TOP = sorted({name.split("/")[0] for name in TRACKED if "/" in name})
LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE = re.compile(r"`([^`\n]+)`")
PLACEHOLDER = re.compile(r"[<>*{}$]|\.\.\.|…")


def _exists(path: Path) -> bool:
    resolved = path.resolve()
    return resolved.is_relative_to(REPO) and resolved.exists()


@pytest.mark.parametrize("doc", DOCS)
def test_relative_links_resolve_inside_the_repository(doc):
    text = (REPO / doc).read_text(encoding="utf-8")
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor
        if not _exists((REPO / doc).parent / target.split("#")[0]):
            broken.append(target)
    assert broken == []


@pytest.mark.parametrize("doc", DOCS)
def test_repository_paths_named_in_backticks_exist(doc):
    text = (REPO / doc).read_text(encoding="utf-8")
    missing = []
    for code in CODE.findall(text):
        for word in code.split():
            word = word.strip("'\",;:()[]")
            first = word.split("/")[0]
            if "/" not in word or first not in TOP or PLACEHOLDER.search(word):
                continue
            path = word.split("::")[0]  # a pytest node id names its file
            if not _exists(REPO / path):
                missing.append(word)
    assert missing == []


@pytest.mark.parametrize("doc", DOCS)
def test_no_reference_to_files_or_trackers_a_user_does_not_have(doc):
    text = (REPO / doc).read_text(encoding="utf-8")
    outside = re.findall(
        r"\.\./shared|\b(?:SCALE|NUMERICS|CLUSTER|DESIGN|REFERENCE|FAMILIES|EVALUATION)\.md", text
    )
    issues = re.findall(r"\bissue #?\d+", text, flags=re.IGNORECASE)
    assert outside == [] and issues == []
