"""A run stored from a recorded output folder (``tests/data/demo_run``: 40 steps of the demo on the
tiny model, ``metrics.jsonl`` and 16 completions per step of ``completions.jsonl``, recorded from
``tests/test_demo_learning.py``; each completion's ``reference`` and each step's ``timestamp``, which
the trainer writes since, were added from the prompt and the cumulative ``perf/step_s``), read by the
supervisor's own reader (``worker.tailer``), so a page
shows what a live run's ingest stores. Used by the run page's phone test and ``scripts/screenshots.py``.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from django.utils import timezone

from controlplane.runs.models import Run, RunStatus
from trainer.tasks.demo import demo_run_document
from worker.tailer import RunOutputTailer

DEMO_RUN_DIR = Path(__file__).resolve().parent / "data" / "demo_run"


def recorded_run(owner, source: Path = DEMO_RUN_DIR) -> tuple[Run, Path]:
    """A completed run of ``owner``'s whose output folder (returned; the caller removes it) is a copy
    of ``source``, ingested as the worker would."""
    output = Path(tempfile.mkdtemp(prefix="grpo-recorded-run-"))
    for name in ("metrics.jsonl", "completions.jsonl"):
        if (source / name).exists():
            shutil.copy(source / name, output / name)
    doc = demo_run_document()
    doc["args"]["max_steps"] = 40
    now = timezone.now()
    run = Run.objects.create(
        owner=owner,
        name="demo: arithmetic on the tiny model",
        config=doc,
        config_sha256="0" * 64,
        status=RunStatus.COMPLETED,
        launched_at=now,
        started_at=now,
        finished_at=now,
        attempt=1,
        output_dir=str(output),
        tags=["demo", "tiny"],
        note="The demo run: held-out single-digit facts, rewarded for the right answer only.",
    )
    RunOutputTailer(run_id=run.pk, output_dir=output).drain()
    return run, output
