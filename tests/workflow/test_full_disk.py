"""A full disk: the results directory is a real 4 MB tmpfs (mounted in a private mount namespace by
``unshare``), the reference logits need 16 MB. The stage stops with one line naming the keyed directory,
what the job asks for and what is free; nothing partial is left; planning warned beforehand; after the
tmpfs grows (space freed) the same command succeeds."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = """
set -u
mkdir -p results
mount -t tmpfs -o size=4m mixquant-full results
{py} -m mixquant.cli plan > plan.out 2>&1; echo $? > plan.rc
{py} -m snakemake --cores 2 {target} > run1.out 2>&1; echo $? > run1.rc
ls -A results/reference_logits > run1.ls 2>/dev/null
mount -o remount,size=64m results
{py} -m snakemake --cores 2 {target} > run2.out 2>&1; echo $? > run2.rc
{py} check.py {target} > verify.out 2>&1
"""
CHECK = """import json, sys
from mixquant.keys.manifest import verify_manifest
print(json.dumps(verify_manifest(sys.argv[1])))
"""


def unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not unshare_works(), reason="needs unshare -rm (user and mount namespaces) for a tmpfs")
def test_a_full_disk_stops_in_one_line_leaves_nothing_partial_and_the_rerun_succeeds(workdir):
    wd = workdir
    target = json.loads(wd.mixquant("paths", "--json").stdout)["reference_logits"]["path"]
    script = SCRIPT.format(py=sys.executable, target=target)
    (wd.root / "check.py").write_text(CHECK)
    subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=wd.root, check=True, timeout=900)
    read = lambda name: (wd.root / name).read_text()  # noqa: E731

    # planning said the plan does not fit
    assert read("plan.rc").strip() == "0"
    assert any(
        line.startswith("warning: the plan writes ")
        and "to results/, whose filesystem has 0.004 GB free" in line
        for line in read("plan.out").splitlines()
    ), read("plan.out")[-2000:]
    # the stage stopped with one line: the keyed directory, what the job asks for, what is free
    assert read("run1.rc").strip() != "0"
    lines = [line for line in read("run1.out").splitlines() if line.startswith("mixquant: ")]
    assert len(lines) == 1, read("run1.out")[-3000:]
    assert lines[0].startswith(f"mixquant: no space left on device writing {target}: this job asks for ")
    assert "MB of disk, 4.1 MB are free on results/reference_logits (the stage had written " in lines[0]
    # nothing partial: no keyed directory, no temporary one
    assert read("run1.ls").split() in ([], [Path(target).name])
    if read("run1.ls").split():  # only the empty output directory Snakemake makes before the job
        pytest.fail(f"{target} was left behind after the failed run")
    # space freed: the same command finishes and the result verifies against its manifest
    assert read("run2.rc").strip() == "0", read("run2.out")[-3000:]
    assert json.loads(read("verify.out")) == []
