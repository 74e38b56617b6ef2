#!/usr/bin/env bash
# Fill tools/wheels with the wheels tools/gpu-check.sh installs on a GPU machine that has no network.
# Run it here (with PyPI): tools/gpu-check-wheels.sh [--python-version 3.12] [--dest tools/wheels]
#
# --python-version is the GPU machine's Python (3.12 on the lent H200s: /opt/torch/.venv/bin/python3);
# it picks the compiled wheels (pydantic-core, regex; tokenizers and safetensors are abi3). The versions
# are the project's pins (pyproject.toml / the repo venv). The folder is emptied first, so it holds
# exactly these wheels: two versions of one package would stop the install there. tools/wheels/ must
# stay out of git (add it to .gitignore); it travels to the device as an ignored path named in `carry`.
set -euo pipefail

python_version=3.12
dest="$(cd "$(dirname "$0")" && pwd)/wheels"
python=${PYTHON:-python3}
while [ $# -gt 0 ]; do
    case "$1" in
        --python-version) python_version=$2; shift 2 ;;
        --dest) dest=$2; shift 2 ;;
        -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
        *) echo "gpu-check-wheels.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done

# Always installed there (the machine has transformers 5.17, which lacks the laguna model type):
always=(transformers==5.24.0 nvidia-modelopt==0.47.0)
# Installed there only when missing or too old for the wheels above (tools/gpu-check.sh decides):
# ModelOpt's import-time needs the H200 image lacks (pydantic with its core, omegaconf, PuLP), and the
# pins transformers 5.24 checks at import (safetensors>=0.8, tokenizers>=0.23.1, regex>=2025.10.22).
fill=(
    safetensors==0.8.0 tokenizers==0.23.3 regex==2026.11.19
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
    typing-extensions==4.16.0 omegaconf==2.4.0 pulp==3.3.2
)

mkdir -p "$dest"
rm -f "$dest"/*.whl
"$python" -m pip download --quiet --no-deps --only-binary=:all: \
    --python-version "$python_version" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dest" "${always[@]}" "${fill[@]}"
du -ch "$dest"/*.whl
