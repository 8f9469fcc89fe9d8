# The two commands a newcomer needs: `make run` and `make test` (see README.md).
PORT ?= 8000
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: install run test lint format tiny clean

install:  ## create/reuse .venv and install pinned dependencies (idempotent)
	@bash scripts/install.sh

run: install  ## web + worker + demo run on the embedded tiny model; Ctrl-C stops everything
	@exec $(PY) manage.py runstack --port $(PORT)

test:  ## the whole suite: lint, format check, pytest on the real services
	@bash scripts/install.sh --system
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest

lint:
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format:
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

tiny: install  ## build the embedded tiny model into ~/.cache/grpo/tiny (cached per source hash)
	$(PY) -c "from trainer.registry import resolve_model; print(resolve_model('tiny'))"

clean:
	rm -rf var .pytest_cache .ruff_cache
