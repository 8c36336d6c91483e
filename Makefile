# Two commands do everything on a fresh machine:
#   make demo   # venv + install (torch pinned by constraints.txt), tiny model + data, SFT, RM, GRPO
#   make test   # venv + install, then the whole test suite
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
ROLLOUT := $(BIN)/rollout
PIP_INSTALL := $(BIN)/pip install --disable-pip-version-check -q -c constraints.txt
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install install-bench demo test test-fast bench lint schema clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) -e '.[torch,postgres,serve,dev]'
	touch $@

install-bench: install
	$(PIP_INSTALL) -e '.[torch,bench]'

# The report is `rollout eval`: every eval is stored (rollout eval list/show/compare) and the
# last two commands print the GRPO gain on the arithmetic set and one table of every eval.
EVAL := OMP_NUM_THREADS=1 $(ROLLOUT) eval --storage-path local/rollout.db --object-path local/object-store --seed 0
ARITH := --env arithmetic --data local/data/arithmetic/eval_prompts.jsonl --max-tokens 6
CALC := --env calculator --data local/data/calculator/eval_prompts.jsonl --max-turns 3 --max-tokens 48 --temperature 0

# The data files and the evals run two at a time (`A & p=$$!; B; $(BOTH_DONE)`: the demo fails if
# either fails), each eval at one torch thread: two 2-thread processes on 2 cores spin against
# each other (an eval took 15 s beside another instead of 4 s alone; 5.4 s for a 1-thread pair).
# Training stays one job at a time, at the default 2 threads: two 1-thread training lanes side by
# side took longer (tools SFT 302 s instead of 173 s beside the RM) and changed the float path the
# demo's figures came from.
BOTH_DONE := s=$$?; wait $$p && exit $$s
demo: install
	$(ROLLOUT) model init-tiny local/models/tiny --force & p=$$!; $(ROLLOUT) data arithmetic local/data/arithmetic; $(BOTH_DONE)
	$(ROLLOUT) data calculator local/data/calculator & p=$$!; $(ROLLOUT) data calculator local/data/calculator-cold --n-sft 2000 --direct-share 0.8; $(BOTH_DONE)
	$(ROLLOUT) train sft --config examples/sft-tiny.toml
	$(ROLLOUT) train rm --config examples/rm-tiny.toml
	$(ROLLOUT) train sft --config examples/sft-warmup.toml
	$(ROLLOUT) train grpo --config examples/grpo-tiny.toml
	$(ROLLOUT) train sft --config examples/tools-sft-tiny.toml
	$(ROLLOUT) train sft --config examples/tools-cold-sft-tiny.toml
	$(ROLLOUT) train grpo --config examples/tools-grpo-tiny.toml
	$(EVAL) $(ARITH) --temperature 0 --model local/models/tiny --name "arithmetic: tiny, untrained" >/dev/null & p=$$!; \
	$(EVAL) $(ARITH) --temperature 0 --model local/models/sft-tiny --name "arithmetic: sft-tiny" >/dev/null; $(BOTH_DONE)
	$(EVAL) $(ARITH) --n 8 --model local/models/sft-warmup --name "arithmetic: sft-warmup (grpo start)" >/dev/null & p=$$!; \
	$(EVAL) $(ARITH) --n 8 --model local/models/grpo-tiny --name "arithmetic: grpo-tiny" >/dev/null; $(BOTH_DONE)
	$(EVAL) $(CALC) --model local/models/sft-tiny --name "calculator: sft-tiny (no tool traces)" >/dev/null & p=$$!; \
	$(EVAL) $(CALC) --model local/models/tools-sft-tiny --name "calculator: tools-sft-tiny" >/dev/null; $(BOTH_DONE)
	$(EVAL) $(CALC) --model local/models/tools-cold-sft-tiny --name "calculator: tools-cold-sft-tiny (grpo start)" >/dev/null & p=$$!; \
	$(EVAL) $(CALC) --model local/models/tools-grpo-tiny --name "calculator: tools-grpo-tiny" >/dev/null; $(BOTH_DONE)
	$(ROLLOUT) eval compare "arithmetic: sft-warmup (grpo start)" "arithmetic: grpo-tiny" --table --storage-path local/rollout.db
	$(ROLLOUT) eval compare "calculator: tools-cold-sft-tiny (grpo start)" "calculator: tools-grpo-tiny" --table --storage-path local/rollout.db
	$(ROLLOUT) eval list --table --limit 8 --storage-path local/rollout.db
	@echo "rm:      held-out pair accuracy is eval/pair_accuracy of the rm run (printed above when it ended)"
	@echo "runs:    $(ROLLOUT) runs list --storage-path local/rollout.db"
	@echo "results: local/ (rollout.db, object-store/, runs/<run-id>/events.jsonl, models/*)"

# Two workers (one torch thread each), whole files per worker so a module's fixtures are built once;
# files in collection order (tests/conftest.py puts the two longest first, one per worker).
# --durations lists the 25 slowest tests at the end (where the suite's time goes).
test: install
	OMP_NUM_THREADS=1 $(BIN)/pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25

test-fast: install
	$(BIN)/pytest -q -m "not slow"

# Every benchmark against its peer (TRL, transformers' generate and serve, a bare PyTorch loop), interleaved,
# at 1 and 2 threads; writes benchmarks/results/<date>-<host>.md and .json. ~15 min on 2 cores.
# BENCH_ARGS= (empty) for the longer run; e.g. BENCH_ARGS="--quick --only sft,dpo --threads 1".
BENCH_ARGS ?= --quick
bench: install-bench
	$(BIN)/python benchmarks/run_all.py $(BENCH_ARGS)

lint: install
	$(BIN)/ruff check src tests benchmarks examples

schema: install
	$(ROLLOUT) schema > schema/run-config.schema.json

clean:
	rm -rf local .pytest_cache
