"""The portable CPU numerics profile: overrides what the shell exported, stops when it did not take effect."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from mixquant.config import validate_config
from mixquant.graph import resolve_artifacts
from mixquant.keys.stages import torch_decides_numbers
from mixquant.numerics import key_identity, portable_environment, profile_settings

# A small random bf16 linear + SDPA forward (ATen's gemm and MKL's bf16 GEMM, the two code paths the toy's
# logits go through on an AVX2 host), hashed, with the process's effective numerics.
FORWARD = """
import hashlib, json, sys
from mixquant.numerics import enter
fingerprint = enter()
import torch
torch.manual_seed(0)
x = torch.randn(1, 2, 96, 64).to(torch.bfloat16)
w = torch.randn(64, 64).to(torch.bfloat16)
y = torch.nn.functional.scaled_dot_product_attention(x @ w, x, x, is_causal=True)
digest = hashlib.sha256(y.float().numpy().tobytes()).hexdigest()
print(json.dumps({"sha256": digest, "numerics": fingerprint["decisive"]}))
"""


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    clean = {
        k: v for k, v in os.environ.items() if k not in portable_environment() and k != "MIXQUANT_NUMERICS"
    }
    return subprocess.run(
        [sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True, timeout=300
    )


def test_profile_overrides_what_the_shell_exported():
    plain = _run(FORWARD)
    hostile = _run(FORWARD, ATEN_CPU_CAPABILITY="default", MKL_CBWR="AUTO", OMP_NUM_THREADS="2")
    assert plain.returncode == 0 and hostile.returncode == 0, plain.stderr + hostile.stderr
    a, b = json.loads(plain.stdout), json.loads(hostile.stdout)
    assert a == b  # same bits, same effective numerics
    assert a["numerics"]["cpu_capability"] == "AVX2"
    assert a["numerics"]["mkl_cbwr"] == "COMPATIBLE"
    assert a["numerics"]["mkldnn"] is False and a["numerics"]["threads"] == 1


def test_native_follows_the_shell_and_gives_other_bits_under_another_capability():
    portable = json.loads(_run(FORWARD).stdout)
    # oneDNN held to AVX2 as well: on AVX512-BF16/AMX hosts its BF16 GEMM otherwise packs for AMX, which
    # torch refuses under the DEFAULT capability ("pack_vnni2 is only supported when avx512 is supported")
    native = _run(
        FORWARD, MIXQUANT_NUMERICS="native:1", ATEN_CPU_CAPABILITY="default", ONEDNN_MAX_CPU_ISA="AVX2"
    )
    assert native.returncode == 0, native.stderr
    document = json.loads(native.stdout)
    assert document["numerics"]["profile"] == "native" and document["numerics"]["cpu_capability"] == "DEFAULT"
    assert document["sha256"] != portable["sha256"]  # the knob the profile pins really decides bits


def test_a_process_whose_capability_was_fixed_before_stops_with_one_line():
    code = (
        "import os, torch\n"
        "os.environ['ATEN_CPU_CAPABILITY'] = 'default'\n"
        "torch.ones(4) + 1\n"  # the dispatch reads the capability once: DEFAULT from here on
        "print(torch.backends.cpu.get_cpu_capability())\n"
        "from mixquant.numerics import NumericsError, enter\n"
        "try:\n    enter('portable', 1)\nexcept NumericsError as e:\n    print('ERROR', e)\n"
    )
    result = _run(code)
    lines = result.stdout.strip().splitlines()
    assert lines[0] == "DEFAULT", result.stderr
    assert lines[1].startswith("ERROR numerics profile 'portable' needs ATen CPU capability AVX2")
    assert len(lines) == 2


def test_key_identity_is_host_independent_only_when_portable():
    assert key_identity("portable", 1) == profile_settings("portable", 1)
    assert "host_isa" not in key_identity("portable", 1)
    assert key_identity("native", 1)["host_isa"] in ("avx512", "avx2", "default")
    with pytest.raises(RuntimeError, match="unknown profile"):
        profile_settings("fast")


def _raw() -> dict:
    return yaml.safe_load((Path(__file__).parents[1] / "config" / "config.yaml").read_text())


def _keys(**numerics):
    raw = _raw()
    raw["numerics"] = {**raw.get("numerics", {}), **numerics}
    return {name: art.key for name, art in resolve_artifacts(validate_config(raw)).items()}


def test_profile_enters_the_keys_of_computing_stages_only():
    portable, native, threads = _keys(cpu="portable"), _keys(cpu="native"), _keys(threads=2)
    for name, art in resolve_artifacts(validate_config(_raw())).items():
        config = art.preimage["config"]
        assert ("numerics" in config) == torch_decides_numbers(art.stage), name
        if torch_decides_numbers(art.stage):
            assert config["numerics"] == {"device": "cpu", **key_identity("portable", 1)}
            assert art.settings["numerics"] == {"profile": "portable", "threads": 1, "device": "cpu"}
            assert portable[name] != native[name] and portable[name] != threads[name], name
    assert portable == _keys()  # the default is portable, one thread


def test_on_aarch64_the_portable_profile_pins_neon_and_no_x86_setting(monkeypatch):
    """A Grace (aarch64) node: the profile pins ATen's DEFAULT (NEON) capability, sets nothing x86 (no
    AVX2, no oneDNN ISA, no MKL), and its key differs from x86-64's; the x86 profile is unchanged. Checked
    here as far as an x86 host can: the profile logic, and a process entering it end to end."""
    import platform

    x86 = profile_settings("portable", 1)
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    arm = profile_settings("portable", 1)
    assert arm["cpu_capability"] == "DEFAULT" and arm["mkl_cbwr"] is None and arm["architecture"] == "aarch64"
    assert arm["environment"] == {
        "ATEN_CPU_CAPABILITY": "default",
        "OMP_DYNAMIC": "FALSE",
        "OMP_NUM_THREADS": "1",
    }
    assert key_identity("portable", 1) != x86
    monkeypatch.undo()
    assert profile_settings("portable", 1) == x86 and x86["cpu_capability"] == "AVX2"
    # a process that believes it is on aarch64 enters the profile and computes (torch's DEFAULT kernels)
    code = (
        "import platform; platform.machine = lambda: 'aarch64'\n"
        "from mixquant.numerics import enter\n"
        "print(enter('portable', 1)['decisive']['cpu_capability'])\n"
    )
    done = _run(code)
    assert done.returncode == 0 and done.stdout.strip() == "DEFAULT", done.stderr
