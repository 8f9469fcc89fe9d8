"""The processes of a run: how they start, what they check of each other, how they stop and resume.

- :mod:`.cli`: ``python -m trainer train --config RUN.yaml``, one run standalone (what the worker launches);
- :mod:`.serve`: ``python -m trainer serve MODEL``, a vLLM server set up for async GRPO training;
- :mod:`.server_checks`: synchronous checks of the vLLM server from the trainer process;
- :mod:`.host`: what the trainer takes of its host (CPU threads, where each rank runs, the process group);
- :mod:`.spawn_startup`: what a spawned rollout process says when it dies while still starting up;
- :mod:`.interrupt`: graceful interrupt (checkpoint at the end of the current step, then stop);
- :mod:`.rollout_state`: ``rollout_state.json`` in a checkpoint, where the rollout resumes.

The rollout process itself is :mod:`trainer.rollout`. ``import trainer`` imports this package (for
:mod:`.spawn_startup`), so it stays empty: stdlib only, nothing imported here.
"""
