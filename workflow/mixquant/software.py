"""Whether each conda environment resolves, checked the way Snakemake and conda will build it.

What happens to ``envs/<name>.yaml`` under ``software-deployment-method: conda`` (Snakemake 9.27
``deployment/conda.py``: ``Env._get_hash``, ``Env.address``, ``create_env``; conda
``env/installers/pip.py``: ``install``, ``_pip_install_via_requirements``):

1. Snakemake copies the file to ``.snakemake/conda/<md5>_.yaml``, the md5 taken over the real path of
   ``.snakemake/conda`` and the file's bytes, and runs ``conda env create --file`` on the copy.
2. conda installs the conda dependencies (python, pip), writes the pip section, one line per entry, to
   ``condaenv.<random>.requirements.txt`` in the copy's directory and runs
   ``python -m pip install -U -r <that file> --exists-action=b`` with that directory as the working
   directory (``pip_workdir = dirname(abspath(file))``): a relative path in the pip section is relative to
   ``.snakemake/conda/``.

:func:`resolve_env` does exactly that in a scratch working directory, with pip's resolver in ``--dry-run``
mode and the package index alone (pip's own configuration files and local wheel directories ignored: a
cluster node has neither; ``PIP_INDEX_URL`` is honoured, for a site's mirror). It then checks what the keys
assume: every package that decides the numbers of a stage running in the env resolves to the env file's
exact pin, or is not installed at all when the file does not list it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from mixquant.jsonio import write_json_atomic
from mixquant.keys.environments import EnvFile, canonical_name, env_path, read_env_file
from mixquant.keys.stages import STAGES, stage_env

DEFAULT_INDEX = "https://pypi.org/simple"
RESOLVE_TIMEOUT_S = 900
CACHE_DIR = Path(".snakemake") / "mixquant-envs"


@dataclass
class EnvResolution:
    """What pip's resolver said about one environment file."""

    env: str  # envs/<name>.yaml
    status: str  # "resolves" | "fails" | "not checked"
    detail: str  # one line: what it installs, the failure, or why it was not checked
    installs: dict[str, str] = field(default_factory=dict)  # canonical name -> version
    seconds: float = 0.0
    python: str = ""  # the interpreter version pip resolved for
    checked_at: float = 0.0  # time.time()

    def to_json(self) -> dict:
        return asdict(self)


def snakemake_env_copy(env: EnvFile, workdir: str | Path) -> Path:
    """Where Snakemake copies ``env`` for a workflow run from ``workdir``: ``.snakemake/conda/<md5>_.yaml``.

    The md5 is Snakemake's ``Env._get_hash(include_location=True)`` for a file-based env without a
    container, pin or post-deploy file: the real path of the envs directory, then the file's content.
    """
    envs_dir = Path(workdir) / ".snakemake" / "conda"
    digest = hashlib.md5(usedforsecurity=False)
    digest.update(os.path.realpath(envs_dir).encode())
    digest.update(env.path.read_bytes())
    return envs_dir / f"{digest.hexdigest()}_.yaml"


def index_url() -> str:
    return os.environ.get("PIP_INDEX_URL") or DEFAULT_INDEX


def index_reachable(url: str | None = None, timeout: float = 5.0) -> bool:
    """Whether the package index's host accepts a connection."""
    parsed = urlparse(url or index_url())
    if parsed.scheme == "file":
        return Path(parsed.path).exists()
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname or "", port), timeout=timeout):
            return True
    except OSError:
        return False


def _pip_environment() -> dict[str, str]:
    """The process environment for pip: no PIP_* settings (find-links, constraints) but the index."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull  # pip then reads no configuration file at all
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def resolve_env(
    env: EnvFile,
    workdir: str | Path | None = None,
    python: str = sys.executable,
    timeout: float = RESOLVE_TIMEOUT_S,
) -> EnvResolution:
    """Resolve ``env``'s pip section as conda will when Snakemake creates the env (module docstring)."""
    shown = f"envs/{env.name}.yaml"
    version = subprocess.run(
        [python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not index_reachable():
        return EnvResolution(
            shown, "not checked", f"no network: {index_url()} is not reachable", python=version
        )
    started = time.monotonic()
    scratch = Path(tempfile.mkdtemp(prefix="mixquant-env-", dir=workdir))
    try:
        copy = snakemake_env_copy(env, scratch)
        copy.parent.mkdir(parents=True)
        shutil.copyfile(env.path, copy)
        with tempfile.NamedTemporaryFile(
            "w", prefix="condaenv.", suffix=".requirements.txt", dir=copy.parent, delete=False
        ) as requirements:
            requirements.write("\n".join(env.pip))
        report = copy.parent / "pip-report.json"
        command = [python, "-m", "pip", "install", "-U", "-r", requirements.name, "--exists-action=b"]
        command += ["--dry-run", "--ignore-installed", "--quiet", "--report", str(report)]
        command += ["--index-url", index_url()]
        try:
            done = subprocess.run(
                command,
                cwd=copy.parent,
                env=_pip_environment(),
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return EnvResolution(shown, "fails", f"pip did not finish in {timeout:.0f} s", python=version)
        seconds = time.monotonic() - started
        if done.returncode != 0:
            return EnvResolution(shown, "fails", _pip_error(done.stderr), seconds=seconds, python=version)
        installs = {
            canonical_name(item["metadata"]["name"]): item["metadata"]["version"]
            for item in json.loads(report.read_text("utf-8"))["install"]
        }
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    problem = key_problem(env, installs)
    if problem is not None:
        return EnvResolution(shown, "fails", problem, installs, seconds, version, time.time())
    python_note = (
        f"; checked with Python {version}, the env asks for {env.python}"
        if env.python and not (version == env.python or version.startswith(f"{env.python}."))
        else ""
    )
    return EnvResolution(
        shown,
        "resolves",
        f"{len(installs)} packages{python_note}",
        installs,
        seconds,
        version,
        time.time(),
    )


def _pip_error(stderr: str) -> str:
    """pip's own reason (its last ERROR line), else its last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    return (errors or lines or ["pip failed with no output"])[-1]


def env_stages(env_name: str, kld_engine: str) -> list[str]:
    """The stages whose rule runs in ``envs/<env_name>.yaml`` for this KLD engine."""
    return [stage for stage in STAGES if stage_env(stage, kld_engine) == env_name]


def key_problem(env: EnvFile, installs: dict[str, str]) -> str | None:
    """Why the keys of the stages running in ``env`` would not name what it installs, or None.

    A stage's key holds the env file's exact pin of each package that decides its numbers, or "not
    installed" where the file does not list it: the resolution must agree with both.
    """
    for kld_engine in ("hf", "vllm"):
        for stage in env_stages(env.name, kld_engine):
            for package in STAGES[stage].numerics_packages:
                name = canonical_name(package)
                if name == "mixquant":
                    continue
                pin = env.pins.get(name)
                got = installs.get(name)
                if pin is not None and got != pin:
                    return f"{name} resolves to {got}, not the pinned {pin}"
                if pin is None and name not in env.listed and got is not None:
                    return (
                        f"installs {name} {got} (pulled in by another package), which decides {stage}'s "
                        f"numbers: pin {name}=={got} in envs/{env.name}.yaml so that the keys name it"
                    )
    return None


def cached_resolution(env: EnvFile, cache_dir: Path = CACHE_DIR, **kwargs) -> EnvResolution:
    """:func:`resolve_env`, remembered per env file content under ``.snakemake/mixquant-envs/`` (a
    resolution that failed for want of network is tried again next time)."""
    path = cache_dir / f"{env.name}-{env.sha256[:16]}.json"
    if path.is_file():
        try:
            return EnvResolution(**json.loads(path.read_text("utf-8")))
        except (ValueError, TypeError):
            pass
    resolution = resolve_env(env, **kwargs)
    if resolution.status != "not checked":
        cache_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, resolution.to_json())
    return resolution


def env_report(kld_engine: str, check: bool = True) -> list[tuple[EnvResolution | None, EnvFile, list[str]]]:
    """(resolution or None when not checked, env file, its stages) of every env this KLD engine uses."""
    rows = []
    for name in sorted({stage_env(stage, kld_engine) for stage in STAGES}):
        env = read_env_file(env_path(name))
        rows.append((cached_resolution(env) if check else None, env, env_stages(name, kld_engine)))
    return rows
