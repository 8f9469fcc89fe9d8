# The two commands a newcomer needs: `make run` and `make test` (see README.md).
PORT ?= 8000
VENV := .venv
PY := $(VENV)/bin/python
# make test-fast's selection (tests/test_layers.py reads it from here).
FAST_LAYER := not vllm and not slow and not browser and not faults

# ruff, then pytest with $(1); the last line is the total time and the exit code.
define lint_then_pytest
	@start=$$(date +%s); \
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check . && $(PY) -m pytest $(1); \
	rc=$$?; echo "make $@: $$(( $$(date +%s) - start )) s in all (lint + pytest), exit $$rc"; exit $$rc
endef

.PHONY: install run test test-fast lint format tiny clean

install:  ## create/reuse .venv and install pinned dependencies (idempotent)
	@bash scripts/install.sh

run: install  ## web + worker + demo run on the embedded tiny model; Ctrl-C stops everything
	@exec $(PY) manage.py runstack --port $(PORT)

test:  ## the whole suite (what CI runs): lint, format check, pytest on the real services; ends with the 15 slowest tests and the total time
	@bash scripts/install.sh --system
	$(call lint_then_pytest,)

test-fast:  ## while developing: lint, unit and API tests on the real Postgres and Redis; no vLLM, no browser, no faults (docs/testing.md)
	@bash scripts/install.sh
	$(call lint_then_pytest,-m "$(FAST_LAYER)")

lint:
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format:
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

tiny: install  ## build the embedded tiny model into ~/.cache/grpo/tiny (cached per source hash)
	$(PY) -c "from trainer.registry import resolve_model; print(resolve_model('tiny'))"

clean:
	rm -rf var .pytest_cache .ruff_cache
