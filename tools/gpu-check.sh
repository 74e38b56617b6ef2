#!/usr/bin/env bash
# Prepared GPU check (tools/gpu_check.py) on a machine without network: install the pinned wheels, run,
# leave ONE JSON file. At most ~8 minutes on one H200 (--limit-s, default 480, covers setup + run).
#
#   tools/gpu-check.sh [--wheels DIR] [--out FILE] [--python PY] [--limit-s S] [gpu_check.py options...]
#
# --out defaults to $OUT/gpu-check.json ($OUT set) else ./gpu-check.json; beside it go
# gpu-check-setup.log (the install) and gpu-check.log (the run's progress). Options it does not know
# (--budget-s, --sections, --device, --small, --threads) go to gpu_check.py. Exit status: 0 when the
# JSON was written (failed sections are data inside it), 1 when it could not be.
#
# Wheels (tools/gpu-check-wheels.sh fills --wheels DIR, default tools/wheels, from PyPI; Python 3.12):
#   always installed: transformers 5.24.0 (the project's pin; the machine has 5.17), nvidia-modelopt
#                     0.47.0 (the machine has none);
#   installed only when the machine lacks them or has a version the wheels above (or the ones chosen
#   with them) do not accept: safetensors 0.8.0, tokenizers 0.23.3 (compiled, abi3), regex 2026.11.19
#   (compiled) -- transformers 5.24 checks these three at import; pydantic 2.14.4 + pydantic-core 2.50.5
#   (compiled) + annotated-types 0.8.0 + typing-inspection 0.4.5 + typing-extensions 4.16.0, omegaconf
#   2.4.0 and PuLP 3.3.2 -- ModelOpt imports them at import time (modelopt.torch.opt: pydantic, pulp;
#   modelopt.torch.utils: omegaconf).
# The rest of the import chain of mixquant.numerics, .model.streaming, .quantize.activations,
# .quantize.layer, .search.branches and .search.score is on the H200 image already: torch, numpy,
# scipy (modelopt.torch.nas), rich, requests, pyyaml, packaging, tqdm, filelock, fsspec, sympy, jinja2,
# networkx, psutil, huggingface-hub (>= 1.31 needed; the image has 1.33), nvidia-ml-py, ninja.
#
# Why --target + PYTHONPATH, not a --system-site-packages venv: the machine's python3 is itself a venv
# (/opt/torch/.venv), and a venv made from a venv sees the *base* interpreter's site-packages, not the
# one holding torch. PYTHONPATH comes before site-packages, so these wheels shadow the machine's.
# mixquant itself is not installed: workflow/ goes on PYTHONPATH.
set -u

here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
wheels=$here/wheels
out=${OUT:+$OUT/gpu-check.json}
out=${out:-$PWD/gpu-check.json}
python=${PYTHON:-python3}
limit_s=480
site=${GPU_CHECK_SITE:-/tmp/mixquant-gpu-check-site}
passed=()
while [ $# -gt 0 ]; do
    case "$1" in
        --wheels) wheels=$2; shift 2 ;;
        --out) out=$2; shift 2 ;;
        --python) python=$2; shift 2 ;;
        --limit-s) limit_s=$2; shift 2 ;;
        -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
        *) passed+=("$1"); shift ;;
    esac
done
outdir=$(dirname "$out")
mkdir -p "$outdir" || exit 1
setup_log=$outdir/gpu-check-setup.log
run_log=$outdir/gpu-check.log

pip_install() {
    "$python" -m pip install --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
        --upgrade --target "$site" "$@"
}

# The fill-in wheels to install: those some chosen wheel requires and the machine lacks or has at a
# version outside the requirement (to a fixed point, so pydantic brings its exact pydantic-core).
fill_in_wheels() {
    PYTHONPATH="$site" "$python" - "$wheels" <<'PY'
import sys, zipfile
from importlib import metadata
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name

ALWAYS = {"transformers", "nvidia-modelopt"}
wheels = {canonicalize_name(p.name.split("-")[0]): p for p in Path(sys.argv[1]).glob("*.whl")}


def requirements(path):
    with zipfile.ZipFile(path) as wheel:
        name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
        lines = wheel.read(name).decode("utf-8").splitlines()
    reqs = [Requirement(line.split(":", 1)[1].strip()) for line in lines if line.startswith("Requires-Dist:")]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


def installed(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def satisfied(name, specifiers):
    version = installed(name)
    return version is not None and all(s.contains(version, prereleases=True) for s in specifiers)


chosen = {name for name in wheels if name in ALWAYS}
while True:
    needs = {}
    for name in chosen:
        for req in requirements(wheels[name]):
            needs.setdefault(canonicalize_name(req.name), []).append(req.specifier)
    new = {n for n in wheels if n not in chosen and n in needs and not satisfied(n, needs[n])}
    if not new:
        break
    chosen |= new
for name, specifiers in sorted(needs.items()):
    if name not in wheels and not satisfied(name, specifiers):
        spec = ",".join(str(s) for s in specifiers)
        print(f"warning: {name}{spec} is needed, no wheel, machine has {installed(name)}", file=sys.stderr)
for name in sorted(chosen - ALWAYS):
    print(f"fill-in: {name} (machine has {installed(name)})", file=sys.stderr)
    print(wheels[name])
PY
}

install_wheels() {
    rm -rf "$site" && mkdir -p "$site" || return 1
    local always=() fill=() wheel
    for wheel in "$wheels"/transformers-*.whl "$wheels"/nvidia_modelopt-*.whl; do
        [ -f "$wheel" ] && always+=("$wheel")
    done
    if [ ${#always[@]} -ne 2 ]; then
        echo "need exactly the transformers and nvidia_modelopt wheels in $wheels (tools/gpu-check-wheels.sh)"
        return 1
    fi
    pip_install "${always[@]}" || return 1
    mapfile -t fill < <(fill_in_wheels)
    if [ ${#fill[@]} -gt 0 ]; then
        pip_install "${fill[@]}" || return 1
    fi
}

echo "[gpu-check] installing wheels from $wheels into $site" >&2
if install_wheels >"$setup_log" 2>&1; then status=ok; else status=failed; fi
echo "[gpu-check] setup $status in ${SECONDS}s (log: $setup_log)" >&2

# The run gets what is left of --limit-s; a SIGTERM at the limit still leaves the sections done so far.
left=$((limit_s - SECONDS))
[ "$left" -gt 10 ] || left=10
limit=()
command -v timeout >/dev/null && limit=(timeout --signal=TERM --kill-after=15 "$left")
PYTHONUNBUFFERED=1 PYTHONPATH="$site:$repo/workflow${PYTHONPATH:+:$PYTHONPATH}" \
    "${limit[@]}" "$python" "$here/gpu_check.py" --out "$out" --setup-log "$setup_log" --setup-status "$status" \
    "${passed[@]}" 2>&1 | tee "$run_log" >&2
rc=${PIPESTATUS[0]}

if "$python" -c 'import json, sys; json.load(open(sys.argv[1]))' "$out" 2>/dev/null; then
    exit 0
fi
# No readable JSON from the run: one that says why, so the caller still gets a file.
printf '{"schema": "mixquant-gpu-check/1", "error": "tools/gpu_check.py exited %s without writing %s; see %s", "setup": "%s"}\n' \
    "$rc" "$(basename "$out")" "$(basename "$run_log")" "$status" >"$out" || exit 1
exit 0
