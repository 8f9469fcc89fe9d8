"""The ``vllm.general_plugins`` entry point: registers the ``gloo`` weight-transfer backend.

vLLM calls every function of that entry-point group once per process (API server, engine core,
workers), so registration must tolerate being called again.
"""

from __future__ import annotations


def register() -> None:
    """Register :class:`~trainer.weight_sync.cpu_engine.GlooWeightTransferEngine` as backend ``gloo``.

    Lazy (module path + class name) so processes that never create an engine do not import it.
    """
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from trainer.weight_sync.gloo import BACKEND_NAME

    if BACKEND_NAME in WeightTransferEngineFactory._registry:
        return
    WeightTransferEngineFactory.register_engine(
        BACKEND_NAME, "trainer.weight_sync.cpu_engine", "GlooWeightTransferEngine"
    )
