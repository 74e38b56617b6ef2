"""What the default run prints: one line per job by its name, no third-party noise, and at the end what it
made (read back here from the run's own outputs)."""

import json
import re

import pytest
from conftest import CONSOLE
from mixquant.release.summary import verdict_word

# Lines the default toy run printed before each job was named in one line (Snakemake's job blocks with
# their 64-hex paths, ModelOpt's version warning from every job): 519, measured on the same DAG.
CONSOLE_LINES_BEFORE = 519


@pytest.mark.slow
def test_default_run_console_is_short_and_ends_with_what_it_made(built_workdir):
    wd = built_workdir
    text = (wd.root / CONSOLE).read_bytes().decode()
    # lines as a terminal shows them (and `wc -l` counts them): a progress bar redrawn with \r is one
    lines = text.split("\n")
    assert text.count("\n") <= CONSOLE_LINES_BEFORE // 3, text
    assert not any("is not tested with current version of modelopt" in line for line in lines)
    paths = wd.paths()
    # each job by its stage and what it makes, e.g. "[10:07:06] quantize_layer nvfp4_w4a16 layers 1-8"
    jobs = [line.split("] ", 1)[1] for line in lines if re.match(r"^\[\d\d:\d\d:\d\d\] ", line)]
    assert "quantize_layer nvfp4_w4a16 layers 1-8" in jobs and "run_kld searched kv fp8" in jobs
    assert "assemble_release" in jobs
    # 64-hex keys only where the run says where the release and the checkpoint are
    hex_lines = [line for line in lines if re.search(r"[0-9a-f]{64}", line)]
    assert hex_lines == [
        f"mixquant run release: {paths['release']['path']}/repo",
        f"mixquant run checkpoint: {paths['checkpoint']['path']}",
    ], hex_lines

    start = lines.index("mixquant run made:")
    summary = lines[start + 1 : lines.index(hex_lines[0])]
    placement = json.loads((wd.root / paths["placement"]["path"] / "placement.json").read_text())
    meta = placement["metadata"]
    formats = sorted(set(placement["layers"].values()))
    counts = ", ".join(f"{fmt} {list(placement['layers'].values()).count(fmt)}" for fmt in formats)
    assert summary[0] == (
        f"  placement: search (ilp), routed effective bits {meta['effective_bits']:.2f} "
        f"(target {meta['target_effective_bits']:.2f}); layers: {counts}"
    )
    assert summary[1] == "  NVFP4 rounding: rtn (round to nearest: ModelOpt's export)"  # the default's
    gates = sorted(name for name in paths if name.startswith("gate/"))
    assert len(summary) == 2 + len(gates) + 1
    for name, line in zip(gates, summary[2:], strict=False):
        gate = json.loads((wd.root / paths[name]["path"] / "aggregate.json").read_text())
        _, candidate, kv = name.split("/")
        verdict = verdict_word(gate["verdict"])  # pass, FAIL, REPEAT-REQUIRED or not gated
        assert line.startswith(f"  gate {candidate} kv {kv}: {verdict}, mean KL "), line
        improvement = gate["suite"]["improvement"] if gate.get("suite") else gate.get("improvement")
        if improvement:  # on the suite with its interval when the gate judged one
            reduction = improvement["reduction"]
            than = "lower" if reduction >= 0 else "higher"
            assert f" ({abs(reduction):.1%} {than} than {gate['baseline']}" in line, line
    verify = json.loads((wd.root / paths["verify"]["path"] / "verify.json").read_text())
    assert summary[-1] == "  verify: " + ", ".join(f"{n} {status}" for status, n in verify["counts"].items())
