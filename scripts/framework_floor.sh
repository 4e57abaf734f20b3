#!/usr/bin/env bash
# The framework adapters' tests on the oldest releases pyproject.toml's extras allow.
#
#     make test-frameworks-floor        (or: bash scripts/framework_floor.sh [pytest args])
#
# The project's environment carries the newest framework releases. This installs the floor
# releases (FLOOR below: the [hf] and [lightning] extras' lower bounds, with the hub and
# tokenizers releases that transformers floor accepts) into a directory of their own under
# ~/.cache/resilient/, put first on PYTHONPATH so they shadow the environment's for this run
# only, checks that they are the ones imported, and runs the framework tests against them.
# Too long for CI's budget; run it when a floor or an adapter's seams change
# (docs/integrations.md#versions).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
FLOOR=(transformers==5.3.0 accelerate==1.10.0 lightning==2.5.0
       huggingface_hub==1.33.0 tokenizers==0.22.2 httpx httpcore h11 anyio)
DIR="${RESILIENT_CACHE:-$HOME/.cache/resilient}/frameworks-floor"
STAMP="$DIR/.installed"
if [[ ! -f "$STAMP" || "$(cat "$STAMP")" != "${FLOOR[*]}" ]]; then
    rm -rf "$DIR"
    mkdir -p "$DIR"
    # --no-deps: torch and the rest come from the project's environment, unchanged
    $PY -m pip install -q --target "$DIR" --no-deps "${FLOOR[@]}"
    echo "${FLOOR[*]}" > "$STAMP"
fi
export PYTHONPATH="$DIR${PYTHONPATH:+:$PYTHONPATH}"
FLOOR_PINS="${FLOOR[*]}" $PY - <<'EOF'
import os
import accelerate, lightning, transformers
got = {m.__name__: m.__version__ for m in (transformers, accelerate, lightning)}
pins = dict(p.split("==") for p in os.environ["FLOOR_PINS"].split() if "==" in p)
want = {name: pins[name] for name in got}
assert got == want, f"the floor releases are not the ones imported: {got}, want {want}"
print("floor releases:", got)
EOF
exec $PY -m pytest -q -p no:randomly tests/test_hf_trainer.py tests/test_accelerate_loop.py \
    tests/test_lightning.py "$@"
