"""The library's floors (docs/architecture.md): imports point down, no import circle, files a reader can hold.

Every import of ``workflow/mixquant`` is read with ``ast``, the ones inside functions included (an import
inside a function still runs, and is how a circle hides), and checked against the floor table on
the docs' architecture page.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "workflow"
PACKAGE = LIBRARY / "mixquant"
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(LIBRARY).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


MODULES = _modules()


def _resolve(module: str, path: Path, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The library modules one import statement loads (``from a import b`` loads ``a.b`` where it is one)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:
            base = module.split(".")[: len(module.split(".")) - node.level + (path.name == "__init__.py")]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        names = [f"{prefix}.{alias.name}" for alias in node.names]
        names = [name if name in MODULES else prefix for name in names]
    found = []
    for name in names:
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name and name != module:
            found.append(name)
    return found


def import_edges() -> dict[str, dict[str, int]]:
    """module -> {imported library module: line of the first import}, top-level and in-function alike."""
    edges: dict[str, dict[str, int]] = {}
    for module, path in MODULES.items():
        edges[module] = {}
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _resolve(module, path, node):
                    edges[module].setdefault(target, node.lineno)
    return edges


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def readme_floors() -> dict[str, int]:
    """package -> floor, from the table on the architecture page of the docs."""
    floors = {}
    for line in (ROOT / "docs" / "architecture.md").read_text("utf-8").splitlines():
        row = re.match(r"^\| (\d+) \| ([^|]+) \|", line)
        if row:
            for package in re.findall(r"`([a-z_]+)`", row.group(2)):
                assert package not in floors, f"docs/architecture.md: {package} is on two floors"
                floors[package] = int(row.group(1))
    assert floors, "docs/architecture.md: no floor table"
    return floors


def find_cycle(edges: dict[str, dict[str, int]]) -> list[str] | None:
    """One import circle (a list of modules, first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(edges.get(module, {})):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(edges):
        if module not in state:
            found = visit(module)
            if found:
                return found
    return None


def test_every_package_is_on_the_map():
    floors = readme_floors()
    packages = {package_of(module) for module in MODULES}
    assert sorted(packages - set(floors)) == [], "packages docs/architecture.md does not place"
    assert sorted(set(floors) - packages) == [], "docs/architecture.md names packages that do not exist"


def test_imports_point_down():
    floors = readme_floors()
    upward = [
        f"{module} ({floors[package_of(module)]}) -> {target} ({floors[package_of(target)]}), "
        f"{MODULES[module].relative_to(ROOT)}:{line}"
        for module, targets in import_edges().items()
        for target, line in targets.items()
        if floors.get(package_of(target), 0) > floors.get(package_of(module), 0)
    ]
    assert upward == []


def test_no_import_circle():
    assert find_cycle(import_edges()) is None


def test_no_private_name_from_another_package():
    """A name starting with ``_`` stays in its package: another package importing it is reaching in."""
    reaching = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mixquant."):
                if package_of(node.module) == package_of(module):
                    continue
                reaching += [
                    f"{module} imports {node.module}.{alias.name}"
                    for alias in node.names
                    if alias.name.startswith("_")
                ]
    assert reaching == []


def test_no_module_over_the_limit():
    long = {
        module: n
        for module, path in MODULES.items()
        if (n := len(path.read_text("utf-8").splitlines())) > MAX_LINES
    }
    assert long == {}


def test_the_checks_catch_what_they_look_for():
    """The cycle finder and the floor reader work on a known graph (so the tests above can fail)."""
    assert find_cycle({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": 1}, "b": {}, "c": {"a": 1}}) is None
    floors = readme_floors()
    assert floors["cli"] > floors["graph"] > floors["release"] > floors["keys"] > floors["checkpoint"]


FAMILY_WORDS = re.compile(r"laguna|qwen|deepseek|mixtral|minimax_m2|glm4", re.IGNORECASE)
MODULE_PATHS = re.compile(r"\.mlp\.experts|\.mlp\.gate\b|model\.layers\[")


def _code_strings_and_paths(path: Path) -> list[tuple[int, str]]:
    """String constants (docstrings aside), names and attribute chains of a module's code.

    Prose (a string with a space: a help text's example) may mention a model; an identifier, a model_type,
    a tensor name or a module path may not."""
    tree = ast.parse(path.read_text("utf-8"))
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            found.append((node.lineno, node.value))
        elif isinstance(node, ast.Attribute) and not isinstance(getattr(node, "parent", None), ast.Attribute):
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Name):
            found.append((node.lineno, node.id))
    return found


# The toy is a Laguna by definition; the families are where architectures are named.
FAMILY_HOMES = (
    "mixquant.model.families",
    "mixquant.model.toy",
    "mixquant.model.toy_settings",
    "mixquant.model.instances",  # the families' trained instances: their toys
)


@pytest.mark.parametrize("module", [m for m in MODULES if not m.startswith(FAMILY_HOMES)])
def test_architectures_are_named_only_by_the_families(module):
    named = [
        f"{MODULES[module].relative_to(ROOT)}:{line}: {text[:80]!r}"
        for line, text in _code_strings_and_paths(MODULES[module])
        if not re.search(r"\s", text) and (FAMILY_WORDS.search(text) or MODULE_PATHS.search(text))
    ]
    assert named == []


def _reason_given(lines: list[str], node: ast.stmt) -> bool:
    """Whether an in-function import says why it is there: ``# lazy: ...`` on its lines, or in the comment
    above the block of imports it belongs to."""
    if any("# lazy:" in line for line in lines[node.lineno - 1 : node.end_lineno]):
        return True
    row = node.lineno - 2
    while row >= 0:
        text = lines[row].strip()
        if "# lazy:" in text:
            return True
        if not (text.startswith(("from ", "import ", "#", ")")) or text == "" or text.endswith(",")):
            return False
        row -= 1
    return False


def test_imports_inside_functions_say_why():
    """An import of a library module inside a function hides an edge; it is there only to keep a module that
    planning or the CLI loads free of torch (or pulp, matplotlib, ModelOpt), and says so."""
    silent = []
    for module, path in MODULES.items():
        lines = path.read_text("utf-8").splitlines()
        tree = ast.parse("\n".join(lines))
        top = {id(node) for node in tree.body}
        for node in tree.body:
            if isinstance(node, (ast.If, ast.Try)):  # TYPE_CHECKING and optional imports at the top
                top.update(id(child) for child in ast.walk(node))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in top:
                if _resolve(module, path, node) and not _reason_given(lines, node):
                    silent.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert silent == []
