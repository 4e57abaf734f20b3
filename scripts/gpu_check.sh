#!/usr/bin/env bash
# The GPU checks, in one command, on a machine with one CUDA device (docs/benchmarks.md#gpu),
# ending with one table, a row per check (scripts/gpu_summary.py; also OUT_DIR/summary.md):
#   bash scripts/gpu_check.sh [OUT_DIR]                     (default gpu-output)
# The steps, the most valuable first, each under a timeout of its own so that one that hangs
# cannot take the others' time (a lent machine gives 10 minutes to the whole command; the
# timeouts sum to 540 s, GPU_CHECK_BUDGET_S, which also bounds them all together):
#   env        torch, the device, and whether the runtime imports here           20 s
#   chaos      chaos/gpu/*.toml on cuda:0, four side by side (python -m chaos):
#              kill -9, SIGSTOP, OOM, NaN and preemption, each ending bitwise    130 s
#   hot        a hot replacement, 2 ranks on the one GPU (scripts/gpu_runs.py)    75 s
#   cuda_oom   tests/test_gpu.py: a real CUDA OOM retried bitwise                 30 s
#   stall_N    the async save's stall at N = 1, 4, 16 GiB (scripts/bench_gpu.py)  35/50/100 s
#   hf         recipes/train_hf.py killed and resumed bitwise (scripts/gpu_runs.py) 50 s
#   lightning  the same for recipes/train_lightning.py                            50 s
# Where torch sees no CUDA device (or GPU_CHECK_CUDA=0) every step after env is skipped and
# the table says so. GPU_CHECK_CPU=1 runs them all on the CPU instead, a rehearsal of this
# script where no GPU is (slow: GPU_CHECK_TIME_SCALE=4 multiplies each step's timeout and
# GPU_CHECK_BUDGET_S=2400 widens the whole; its figures mean nothing). Each step's output is
# OUT_DIR/<step>.log, its result a JSON (or XML) file there; the runs' stdout.log files are
# copied to OUT_DIR/runs/ (GPU_CHECK_KEEP=1 keeps the whole work directory too).
# With no venv of ours (a GPU host's own Python and packages), the wheels in .whl/
# (scripts/gpu_wheels.sh) are unpacked onto PYTHONPATH: such a host has no network.
# RESILIENT_UNTESTED_TORCH=1 (the default here) lets a torch outside the tested range run;
# the table names the torch it ran on. Exits 1 when a row is FAIL.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu-output}"
mkdir -p "$out/runs"
out=$(cd "$out" && pwd)
rm -f "$out/steps.jsonl"
py="${PYTHON:-python3}"
[ -x .venv/bin/python ] && py=.venv/bin/python
work=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
# every process a step starts carries this: what a step leaves running is found and killed
# (torch elastic starts each worker in a session of its own, out of timeout's reach)
export GPU_CHECK_TAG="gpu-check-$$-$RANDOM"
export RESILIENT_UNTESTED_TORCH="${RESILIENT_UNTESTED_TORCH:-1}" PYTHONUNBUFFERED=1
if [ ! -x .venv/bin/python ] && compgen -G ".whl/*.whl" >/dev/null; then
    # unpacked, not pip-installed: a wheel is a zip of its site-packages files, and a host's
    # Python may lack pip
    "$py" -c 'import sys, zipfile
for wheel in sys.argv[2:]:
    zipfile.ZipFile(wheel).extractall(sys.argv[1])' "$work/site" .whl/*.whl || exit 1
    export PYTHONPATH="$work/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout first

budget="${GPU_CHECK_BUDGET_S:-540}"
deadline=$((SECONDS + budget))
skip=""  # why the steps are skipped ("" while they run)

note() {  # NAME RC WALL_S TIMEOUT_S WHY_SKIPPED: one line of steps.jsonl
    local timed_out=false why=null
    { [ "$2" = 124 ] || [ "$2" = 137 ]; } && timed_out=true
    [ -n "$5" ] && why="\"$5\""
    printf '{"step": "%s", "rc": %s, "wall_s": %s, "timeout_s": %s, "timed_out": %s, ' \
        "$1" "${2:-null}" "$3" "$4" "$timed_out" >>"$out/steps.jsonl"
    printf '"skipped": %s}\n' "$why" >>"$out/steps.jsonl"
}

reap() {  # kill every process still running with this run's tag in its environment
    "$py" -c 'import os, signal, sys
want = ("GPU_CHECK_TAG=" + sys.argv[1]).encode()
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            if int(pid) != os.getpid() and want in f.read().split(b"\0"):
                os.kill(int(pid), signal.SIGKILL)
    except OSError:
        pass' "$GPU_CHECK_TAG"
}

step() {  # NAME CAP_S CMD...: CMD under a timeout of CAP_S (less when the budget is short)
    local name=$1 cap=$2 left t rc start
    shift 2
    left=$((deadline - SECONDS))
    cap=$((cap * ${GPU_CHECK_TIME_SCALE:-1}))
    t=$((cap < left ? cap : left))
    if [ -n "$skip" ] || [ "$t" -lt 10 ]; then
        note "$name" "" 0 "$t" "${skip:-no time left of the $budget s}"
        echo "[gpu_check] $name: skipped (${skip:-no time left})"
        return
    fi
    start=$SECONDS
    timeout -k 5 "$t" "$@" >"$out/$name.log" 2>&1
    rc=$?
    reap
    note "$name" "$rc" $((SECONDS - start)) "$t" ""
    echo "[gpu_check] $name: exit $rc in $((SECONDS - start)) s (timeout $t s)"
}

cat >"$work/probe.py" <<'EOF'
"""env.json: the Python, torch and device the checks run on; exit 1 when torch or the
runtime does not import."""
import json, platform, subprocess, sys
env = {"python": platform.python_version()}
try:
    import torch
    env.update(torch=torch.__version__, cuda=torch.version.cuda)
    env["cuda_available"] = torch.cuda.is_available() and torch.cuda.device_count() > 0
    if env["cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        env.update(device=props.name, memory_gib=round(props.total_memory / 2**30, 1))
        env["devices"] = torch.cuda.device_count()
    import resilient.checkpoint  # with this torch and these packages
    import resilient.cli
except Exception as e:  # the table's environment row says what
    env["error"] = f"{type(e).__name__}: {e}"
try:
    smi = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
    env["driver"] = subprocess.run(smi, capture_output=True, text=True, timeout=10).stdout.strip()
except (OSError, subprocess.SubprocessError):
    pass
with open(sys.argv[1], "w") as f:
    json.dump(env, f, indent=1)
print(json.dumps(env))
sys.exit(1 if "error" in env else 0)
EOF

step env 20 "$py" "$work/probe.py" "$out/env.json"
dev=cuda
if [ "${GPU_CHECK_CPU:-0}" = 1 ]; then
    dev=cpu  # the rehearsal: every step on the CPU
elif ! grep -q '"cuda_available": true' "$out/env.json" 2>/dev/null; then
    skip="no CUDA device"
elif [ "${GPU_CHECK_CUDA:-1}" = 0 ]; then
    skip="no CUDA device (GPU_CHECK_CUDA=0)"
fi
if grep -q '"error"' "$out/env.json" 2>/dev/null; then
    skip="the runtime does not import here (env.log)"
fi
step chaos 130 "$py" -m chaos --out "$work/chaos" --keep run chaos/gpu/*.toml --jobs 4 \
    --summary "$out/chaos.json"
step hot 75 "$py" scripts/gpu_runs.py hot --device "$dev" --work "$work/hot" --json "$out/hot.json"
# the host's own pytest plugins stay out; one test, in process: no fork server to start
step cuda_oom 30 env PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 TEST_FRESH_INTERPRETERS=1 "$py" -m pytest \
    -p pytest_timeout -p no:cacheprovider -o addopts="" -q -rA tests/test_gpu.py \
    -k real_cuda_oom --junitxml "$out/cuda_oom.xml"
# a warm-up save where time allows: its pinned buffers then exist, as in a run past its first
for spec in 1:3:1:35 4:2:1:50 16:1:0:100; do  # GiB:repetitions:warm-up saves:timeout
    IFS=: read -r gib reps warmup cap <<<"$spec"
    size=(--state-gib "$gib")
    [ "$dev" = cpu ] && size=(--cpu --width 256 --layers 2)  # the rehearsal: a small state
    step "stall_$gib" "$cap" "$py" scripts/bench_gpu.py "${size[@]}" --reps "$reps" \
        --warmup "$warmup" --no-torch-save --dir "$work" --json "$out/stall_$gib.json"
done
for name in hf lightning; do
    step "$name" 50 "$py" scripts/gpu_runs.py "$name" --device "$dev" --work "$work/$name" \
        --json "$out/$name.json"
done

# the runs' own output, for a failure's story (the checkpoints stay behind)
(cd "$work" && find . -name stdout.log -exec cp --parents {} "$out/runs/" \;) 2>/dev/null || true
"$py" scripts/gpu_summary.py "$out"  # reads the chaos runs' logs in $work: before it goes
rc=$?
[ "${GPU_CHECK_KEEP:-0}" = 1 ] || rm -rf "$work"
exit $rc
