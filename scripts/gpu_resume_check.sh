#!/usr/bin/env bash
# Bitwise resume on one GPU under plain torchrun (no `resilient run`): for the DDP and FSDP2
# recipes, a fault-free run of 24 steps against (a) a run stopped at step 10 and resumed, and
# (b) a run killed with SIGKILL once checkpoint 8 is committed, then resumed. Prints one line
# per run and IDENTICAL or DIFFERENT per recipe; exits 1 on any difference.
#   bash scripts/gpu_resume_check.sh WORKDIR [RECIPE ARGS...]   (e.g. --sync-save)
# A run that leaves no digest has its log's tail printed.
set -uo pipefail
cd "$(dirname "$0")/.."
work="${1:?WORKDIR}"
shift
py="${PYTHON:-python3}"
[ -x .venv/bin/python ] && py=.venv/bin/python
common=(--steps 24 --save-every 4 --log-every 100 "$@")
launch() { "$py" -m torch.distributed.run --standalone --nproc-per-node 1 "$@"; }
digest() {  # $1: run dir, $2: the log of its last launch
    if [ -e "$1/final_digest.json" ]; then
        "$py" -c "import json,sys; print(json.load(open(sys.argv[1]))['digest'])" "$1/final_digest.json"
    else
        echo "no digest in $1; the end of $2:" >&2; tail -n 25 "$2" >&2
    fi
}
rc=0
for recipe in train_ddp train_fsdp; do
    w="$work/$recipe"
    rm -rf "$w"; mkdir -p "$w"
    launch "recipes/$recipe.py" "${common[@]}" --ckpt-dir "$w/ca" --run-dir "$w/ra" >"$w/a.log" 2>&1
    launch "recipes/$recipe.py" "${common[@]}" --ckpt-dir "$w/cb" --run-dir "$w/rb" --stop-at 10 >"$w/b1.log" 2>&1
    launch "recipes/$recipe.py" "${common[@]}" --ckpt-dir "$w/cb" --run-dir "$w/rb" >"$w/b2.log" 2>&1
    setsid "$py" -m torch.distributed.run --standalone --nproc-per-node 1 "recipes/$recipe.py" \
        "${common[@]}" --ckpt-dir "$w/cc" --run-dir "$w/rc" >"$w/c1.log" 2>&1 &
    pid=$!
    for _ in $(seq 600); do [ -e "$w/cc/step_000000008/manifest.json" ] && break; sleep 0.1; done
    kill -KILL -- "-$pid" 2>/dev/null; wait "$pid" 2>/dev/null
    killed_at=$(ls "$w/cc" | grep -c '^step_')
    launch "recipes/$recipe.py" "${common[@]}" --ckpt-dir "$w/cc" --run-dir "$w/rc" >"$w/c2.log" 2>&1
    a=$(digest "$w/ra" "$w/a.log") b=$(digest "$w/rb" "$w/b2.log") c=$(digest "$w/rc" "$w/c2.log")
    echo "$recipe fault-free ${a:0:16} stop@10+resume ${b:0:16} kill-9(${killed_at} ckpts)+resume ${c:0:16}"
    if [ -n "$a" ] && [ "$a" = "$b" ] && [ "$a" = "$c" ]; then echo "$recipe IDENTICAL"; else echo "$recipe DIFFERENT"; rc=1; fi
done
exit $rc
