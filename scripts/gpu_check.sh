#!/usr/bin/env bash
# The GPU checks, in one command, on a machine with one CUDA device (docs/benchmarks.md#gpu):
# tests/test_gpu.py (a real CUDA OOM retried bitwise; one-rank kill -9, preemption and NaN
# runs on cuda:0 ending bitwise), scripts/gpu_resume_check.sh (the same under plain torchrun,
# for a torch the supervisor refuses) and scripts/bench_gpu.py (the async save's stall).
#   bash scripts/gpu_check.sh [OUT_DIR]
# With no venv of ours (a GPU host's own Python), wheels of the missing pure dependencies can
# sit in .whl/ (installed into /tmp/site). RESILIENT_UNTESTED_TORCH=1 lets a torch outside the
# tested range run; the run prints which torch it was.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu-output}"
mkdir -p "$out"
py="${PYTHON:-python3}"
[ -x .venv/bin/python ] && py=.venv/bin/python
if compgen -G ".whl/*.whl" >/dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/env.txt"
"$py" -c "import torch, resilient.checkpoint; print('torch', torch.__version__, torch.version.cuda)" 2>&1 | tee -a "$out/env.txt"
rc=0
"$py" -m pytest -q -p no:cacheprovider tests/test_gpu.py -o addopts="" -rA --durations=10 \
    2>&1 | tee "$out/pytest.log" || rc=1
bash scripts/gpu_resume_check.sh /tmp/gpu-resume ${RESUME_ARGS:-} 2>&1 | tee "$out/resume.log" || rc=1
"$py" scripts/bench_gpu.py "${@:2}" 2>&1 | tee "$out/bench_gpu.log" || rc=1
exit $rc
