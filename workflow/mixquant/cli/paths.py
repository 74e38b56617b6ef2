"""`mixquant paths` (every artifact's key, path and state) and `mixquant explain` (why two keys differ)."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from mixquant.cli.context import load_config, planned_artifacts, results_dir_of
from mixquant.jsonio import diff_values
from mixquant.keys.hashing import is_sha256_hex
from mixquant.keys.manifest import read_manifest
from mixquant.planning import artifact_state
from mixquant.rulelog import stage_log_path


def cmd_paths(args: argparse.Namespace) -> int:
    cfg = load_config(args)
    artifacts = planned_artifacts(cfg, args)
    table = {}
    for name, art in artifacts.items():
        state = artifact_state(art, cfg.results_dir)
        software = art.settings["software"]
        row = {
            "key": art.key,
            "path": str(art.path),
            "done": state == "done",
            "state": state,
            "stage": art.stage,
            # where the job runs and the package versions its key holds
            "env": f"envs/{software['env']}.yaml" if software["env"] else software["python"] or "venv",
            "packages": art.preimage["packages"],
        }
        if state == "failed":
            row["log"] = str(stage_log_path(cfg.results_dir, art.stage, art.key))
        table[name] = row
    if args.json:
        print(json.dumps(table, indent=2))
    else:
        for name, row in table.items():
            log = f"  (log: {row['log']})" if "log" in row else ""
            print(f"{name:22} {row['state']:6}  {row['path']}{log}")
    return 0


SHORT_KEY_MIN = 8  # hex digits of the shortest key prefix accepted (mixquant prints 12)
_HEX_PREFIX = re.compile(rf"^[0-9a-f]{{{SHORT_KEY_MIN},64}}$")


def find_keyed_dir(ref: str, results_dir: str | Path) -> Path:
    """A keyed output directory from a key or an unambiguous prefix of one (>= 8 hex digits, as mixquant
    prints 12), searched under results/*/, or a directory path."""
    path = Path(ref)
    if path.is_dir():
        return path
    if not _HEX_PREFIX.match(ref):  # checked before it becomes part of a glob
        raise ValueError(
            f"{ref!r} is neither an output directory nor a key (64 hex digits, or at least "
            f"{SHORT_KEY_MIN} of its first)"
        )
    matches = sorted(p for p in Path(results_dir).glob(f"*/{ref}*") if p.is_dir() and is_sha256_hex(p.name))
    if not matches:
        raise ValueError(f"no output directory with key {ref} under {results_dir}/")
    if len(matches) > 1:
        shown = ", ".join(f"{p.parent.name}/{p.name[:16]}" for p in matches[:4])
        raise ValueError(
            f"key prefix {ref} is ambiguous under {results_dir}/: {len(matches)} directories ({shown})"
        )
    return matches[0]


class KeyedPreimages:
    """The key preimage of a key, a key prefix or an output directory: a built output's manifest, else
    the planned artifact's of that key (the config's plan, computed once when first needed)."""

    def __init__(self, results_dir: str | Path, plan: Any = None) -> None:
        self.results_dir = results_dir
        self._plan = plan  # () -> {name: Artifact}
        self._planned: list | None = None

    def planned(self, ref: str) -> Any:
        """The one planned artifact whose key ``ref`` is (or starts), or None."""
        if self._plan is None or not _HEX_PREFIX.match(ref):
            return None
        if self._planned is None:
            self._planned = list({art.key: art for art in self._plan().values()}.values())
        matches = [art for art in self._planned if art.key.startswith(ref)]
        return matches[0] if len(matches) == 1 else None

    def __call__(self, ref: str) -> tuple[str, dict]:
        """(how to show it, its preimage)."""
        try:
            found = find_keyed_dir(ref, self.results_dir)
        except ValueError as error:
            art = self.planned(Path(ref).name)  # a key, or the path the plan gives it
            if art is None:
                plan = " nor among the config's planned outputs" if self._plan is not None else ""
                raise ValueError(f"{error}{plan}") from None
            return f"{art.path} (planned, not built)", art.preimage
        return str(found), read_manifest(found)["preimage"]


def explain(a: str, b: str, preimages: KeyedPreimages, depth: int = 0) -> list[str]:
    """Human-readable reasons why two keys (built or planned) differ (recursing upstream)."""
    pre_a, pre_b = preimages(a)[1], preimages(b)[1]
    indent = "  " * depth
    lines = []
    if pre_a == pre_b:
        return [f"{indent}identical preimages: same key"]
    for where, left, right in diff_values(pre_a, pre_b):
        lines.append(f"{indent}{where}: {json.dumps(left)} -> {json.dumps(right)}")
        if where.startswith("upstream.") and is_sha256_hex(left) and is_sha256_hex(right):
            try:
                deeper = explain(left, right, preimages, depth + 2)
            except ValueError as error:
                lines.append(f"{indent}  (cannot look further: {error})")
                continue
            lines.append(f"{indent}  because:")
            lines.extend(deeper)
    return lines


def cmd_explain(args: argparse.Namespace) -> int:
    """Built outputs from their manifests; a key that is not built from the config's plan (with the same
    --configfile and --config as the run that will build it)."""

    def plan() -> dict:
        return planned_artifacts(load_config(args), args)

    preimages = KeyedPreimages(args.results_dir or results_dir_of(args), plan)
    (shown_a, _), (shown_b, _) = preimages(args.a), preimages(args.b)
    print(f"A: {shown_a}\nB: {shown_b}")
    print("\n".join(explain(args.a, args.b, preimages)))
    return 0
