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

demo: install
	$(ROLLOUT) model init-tiny local/models/tiny --force
	$(ROLLOUT) data arithmetic local/data/arithmetic
	$(ROLLOUT) train sft --config examples/sft-tiny.toml
	$(ROLLOUT) train rm --config examples/rm-tiny.toml
	$(ROLLOUT) train sft --config examples/sft-warmup.toml
	$(ROLLOUT) train grpo --config examples/grpo-tiny.toml
	$(BIN)/python examples/report.py --data local/data/arithmetic --sft local/models/sft-tiny --rm local/models/rm-tiny \
	    --rl local/models/sft-warmup local/models/grpo-tiny
	@echo "runs:    $(ROLLOUT) runs list --storage-path local/rollout.db"
	@echo "results: local/ (rollout.db, object-store/, runs/<run-id>/events.jsonl, models/sft-tiny, models/rm-tiny, models/grpo-tiny)"

# Two workers (one torch thread each), whole files per worker so a module's fixtures are built once.
test: install
	OMP_NUM_THREADS=1 $(BIN)/pytest -q -n 2 --dist loadfile

test-fast: install
	$(BIN)/pytest -q -m "not slow"

bench: install-bench
	$(BIN)/python benchmarks/sft_throughput.py

lint: install
	$(BIN)/ruff check src tests benchmarks examples

schema: install
	$(ROLLOUT) schema > schema/run-config.schema.json

clean:
	rm -rf local .pytest_cache
