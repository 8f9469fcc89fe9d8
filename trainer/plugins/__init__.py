"""What a run may use by name: models, datasets, reward functions, tools, environments, rollout loops.

- :mod:`.registry`: the registries of those names (entry points and ``GRPO_PLUGIN_MODULES``), the
  dotted-path resolver and the dataset loader;
- :mod:`.builtin_plugins`: the built-in models and datasets as registry entries (entry points in
  ``pyproject.toml``, as a plugin package declares its own);
- :mod:`.hub`: hub models and datasets, a repo id and revision resolved to a commit and a local snapshot.

The built-in reward functions and tools keep their public dotted names, the ones run documents use:
``trainer.rewards`` and ``trainer.builtin_tools``; the built-in tasks are :mod:`trainer.tasks`.
"""
