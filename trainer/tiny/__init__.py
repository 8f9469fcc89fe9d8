"""The embedded tiny model: ``python -m trainer tiny OUTDIR``.

- :mod:`.build`: the build (a local tokenizer, a random-init Qwen3 model, a seeded warm start), its
  cache, and the copy of the shipped build (``trainer/tiny_model/``, package data, at that path);
- :mod:`.chat_template`: its chat template (Qwen3 layout) and the parser for its tool calls, which
  the rollout uses too.

The build is keyed by the hash of its sources (``build.SOURCE_FILES``); the built-in task and tools it
is warm-started on are :mod:`trainer.tasks.arithmetic` and :mod:`trainer.builtin_tools`.
"""
