# Two commands do all set-up on a fresh machine (Python 3.10+): `make demo` and `make test`.
# Each creates .venv in the checkout first (scripts/setup.sh; a no-op when up to date).
PY := .venv/bin/python

.PHONY: setup demo test test-torch test-frameworks-floor lint bench soak clean
setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) -m chaos.demo

# CI (.ci/run): lint, types, the full suite on .venv's torch (2.13.0, constraints-cpu.txt),
# then the compatibility subset on the range's floor (2.11) and newest release (2.15), whose
# side environments are built in the background while the suite runs (scripts/test.sh says
# how; docs/operating.md#torch-releases). Where one cannot be built (no network or disk), that
# release is reported loudly as untested, not failed.
test: setup
	@bash scripts/test.sh

# `make test-torch TORCH=2.14.1`: the demo and the compatibility subset with that torch release
# (TORCH=floor or newest: the ends of pyproject.toml's range), in its side environment
TORCH ?= newest
test-torch: setup
	$(PY) scripts/torch_env.py $(TORCH) --subset

# the Trainer, Accelerate and Lightning tests on the oldest releases the extras allow
# (docs/integrations.md#versions); too long for CI
test-frameworks-floor: setup
	@bash scripts/framework_floor.sh

# the long soak of docs/chaos.md: the tests marked `extended` (left out of `make test` to keep
# CI under its budget), every scenario of chaos/scenarios (some run only here), then 200
# seeded fault schedules, two at a time (about an hour); a quarter of them in hot
# mode (SOAK_HOT=0 for cold only); then 40 seeded healthy runs with slow but legitimate
# events, about a quarter of them with an elastic resize, where no hang verdict may come
# (chaos/quiet.py, about 35 minutes); then 30 seeded faults in the framework recipes, each
# compared bit for bit with a fault-free run (chaos/frameworks.py, about 15 minutes)
SOAK_SEED ?= 2026
SOAK_RUNS ?= 200
SOAK_HOT ?= 0.25
QUIET_RUNS ?= 40
FRAMEWORK_RUNS ?= 30
soak: setup
	$(PY) -m pytest -q -m extended -k "not matrix_scenario"  # the matrix runs next, whole
	$(PY) -m chaos --out chaos-output matrix
	$(PY) -m chaos --out chaos-output soak --seed $(SOAK_SEED) --runs $(SOAK_RUNS) --jobs 2 \
		--hot-fraction $(SOAK_HOT) --summary chaos-output/soak-$(SOAK_SEED).json
	$(PY) -m chaos.quiet --out chaos-output/quiet soak --seed $(SOAK_SEED) --runs $(QUIET_RUNS)
	$(PY) -m chaos.frameworks --out chaos-output/frameworks --seed $(SOAK_SEED) --runs $(FRAMEWORK_RUNS)

bench: setup
	$(PY) scripts/bench_checkpoint.py

clean:
	rm -rf .venv demo-output bench-output chaos-output runs checkpoints
