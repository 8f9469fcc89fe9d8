"""Weight sync from the trainer to the vLLM server (spec: ``weight_sync_steps``, ``perf/weight_sync_*``).

- :class:`WeightSyncClient`: the trainer side (pause → start → transfer → finish → resume).
- :func:`server_info`, :func:`check_dtype`: read the server's config; warn on a dtype mismatch.
- Backends: ``nccl`` (vLLM's built-in engine; sender in :mod:`.nccl`) and ``gloo`` (CPU; receiver in
  :mod:`.cpu_engine`, registered into vLLM by :mod:`.plugin`, sender in :mod:`.gloo`).

Importing this package never imports vLLM, so the trainer runs where vLLM is not installed.
"""

from trainer.weight_sync.client import (
    BACKENDS,
    WeightSyncClient,
    WeightSyncError,
    check_dtype,
    server_backend,
    server_dtype,
    server_info,
)

__all__ = [
    "BACKENDS",
    "WeightSyncClient",
    "WeightSyncError",
    "check_dtype",
    "server_backend",
    "server_dtype",
    "server_info",
]
