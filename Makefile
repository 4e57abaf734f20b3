# Two commands do all set-up on a fresh machine (Python 3.10+): `make demo` and `make test`.
# Each creates .venv in the checkout first (scripts/setup.sh; a no-op when up to date).
PY := .venv/bin/python

.PHONY: setup demo test lint bench clean
setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) -m chaos.demo

test: setup
	$(PY) -m ruff check resilient chaos recipes scripts tests
	$(PY) -m ruff format --check resilient chaos recipes scripts tests
	$(PY) -m mypy
	$(PY) -m pytest -q

bench: setup
	$(PY) scripts/bench_checkpoint.py

clean:
	rm -rf .venv demo-output bench-output runs checkpoints
