#!/usr/bin/env bash
# Fill .whl/ with wheels of the packages a GPU host's own Python lacks, for
# scripts/gpu_check.sh, which unpacks them onto PYTHONPATH there (such a host has no network;
# the wheels travel with the checkout, 64 MiB at most in all). Not torch, transformers,
# accelerate or lightning: the host's own are what the checks are about; nor numpy, psutil or
# safetensors, which those bring. Versions are this checkout's .venv's where it has them.
#   bash scripts/gpu_wheels.sh [DEST]          (default .whl; needs pip and PyPI)
# Prints each wheel and the total, and fails when the total is over 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${1:-.whl}"
py="${PYTHON:-python3}"
[ -x .venv/bin/python ] && py=.venv/bin/python
limit_mib=64
target=(--python-version 3.12 --implementation cp --abi cp312
    --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64)

# imported by the runtime, the recipes and the chaos harness (crc32c is the one binary)
needed=(torchdata tenacity structlog fsspec crc32c prometheus-client nvidia-ml-py)
# s3fs and its own dependencies: no GPU check imports it (their checkpoints are local), but
# the runtime declares it; wrapt is binary, aiohttp comes with lightning's fsspec[http]
s3=(s3fs aiobotocore botocore jmespath aioitertools python-dateutil six wrapt)
# python -m pytest for tests/test_gpu.py (pytest-timeout: its tests' time limits)
testing=(pytest pluggy iniconfig pytest-timeout pygments)

pinned=()
for name in "${needed[@]}" "${s3[@]}" "${testing[@]}"; do
    version=$("$py" -c 'import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass' "$name")
    pinned+=("$name${version:+==$version}")
done
rm -rf "$dest"
mkdir -p "$dest"
"$py" -m pip download -q --no-deps --only-binary=:all: "${target[@]}" -d "$dest" "${pinned[@]}" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
ls -1 "$dest"
bytes=$(cat "$dest"/*.whl | wc -c)
mib=$(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1048576 }')
echo "gpu_wheels: ${#pinned[@]} wheels, $mib MiB in $dest (limit $limit_mib MiB)"
if [ "$bytes" -gt $((limit_mib * 1048576)) ]; then
    echo "gpu_wheels: over $limit_mib MiB: they would not travel with the checkout" >&2
    exit 1
fi
