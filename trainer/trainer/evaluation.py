"""The trainer's side of evaluation during training (an extension beyond the spec, issue 30).

transformers' Trainer decides when (``eval_strategy``, ``eval_steps``, ``eval_on_start``) and calls
``evaluate()``; :class:`EvalBook` turns each call into an
:class:`~trainer.rollout.evaluation.EvalRequest` for the rollout process, which samples and scores
the eval prompts beside the rollouts (``trainer/rollout/evaluation.py``), and writes each result to
the sinks at the step whose weights it evaluated. Before the next weight sync replaces those weights
the trainer waits for the pass (:meth:`EvalBook.wait`), so an eval never mixes two policies.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from trainer.rollout.evaluation import EvalRequest, EvalResult

__all__ = ["EvalBook"]

logger = logging.getLogger(__name__)

WAIT_POLL_S = 0.05


class EvalBook:
    """Eval passes asked for and not yet written, and the step/version the server holds.

    ``emit(kind, *record)``: the trainer's one way to its sinks (``AsyncGRPOTrainer._emit``); a result
    goes out as ``emit("evaluation", step, metrics, completions, timestamp)``.
    """

    def __init__(self, emit: Callable[..., None]) -> None:
        self._emit = emit
        self.pending: list[int] = []  # steps asked for, oldest first
        self.synced_step = 0  # the optimizer step whose weights the server holds
        self.synced_version = 0
        self._asked: tuple[int, int] | None = None  # (step, version) of the last pass asked for

    def synced(self, *, step: int, version: int) -> None:
        """The server now holds the weights of ``step`` as policy ``version``."""
        self.synced_step, self.synced_version = int(step), int(version)

    def request(self, handle: Any) -> EvalRequest | None:
        """Ask the rollout process (``handle``: its RolloutWorkerHandle) for a pass over the weights
        the server holds; returns the request, or None when those weights were asked for already
        (transformers asks twice at the last step: its step rule and its end-of-training rule)."""
        if self._asked == (self.synced_step, self.synced_version):
            return None
        request = EvalRequest(step=self.synced_step, version=self.synced_version, timestamp=time.time())
        handle.request_eval(request)
        self._asked = (request.step, request.version)
        self.pending.append(request.step)
        return request

    def take(self, payload: dict[str, Any]) -> bool:
        """Write the result a metrics payload carries (``{"eval": EvalResult}``); False if it carries none."""
        result: EvalResult | None = payload.get("eval")
        if result is None:
            return False
        self._emit("evaluation", result.step, result.metrics, result.completions, result.timestamp)
        if result.step in self.pending:
            self.pending.remove(result.step)
        logger.info(
            "eval of step %d: %s",
            result.step,
            ", ".join(f"{k}={v:.4g}" for k, v in sorted(result.metrics.items()) if isinstance(v, float)),
        )
        return True

    def wait(self, handle: Any, drain: Callable[[], None]) -> float:
        """Block until every pass asked for is written (``drain`` reads the metrics queue, handing
        eval results to :meth:`take`); the rollout process's death or silence raises through
        ``handle.check_health()``. Returns the seconds waited."""
        started = time.perf_counter()
        while True:
            drain()
            if not self.pending:
                return time.perf_counter() - started
            handle.check_health()
            time.sleep(WAIT_POLL_S)
