"""Runs and what they produce: metrics, sampled completions, checkpoints, events.

Thin models (HackSoft style): fields and database constraints only. Everything that changes a row
lives in :mod:`controlplane.runs.services`; reads live in :mod:`controlplane.runs.selectors`.

Status life cycle::

    queued -> starting -> running -> completed | failed
                  \\          \\-> stopping -> stopped
                   \\          \\-> interrupted  (its worker was shut down; the trainer saved a checkpoint)
                   \\-> failed | stopping | interrupted
    failed | stopped | interrupted --resume--> queued   (a new attempt from the latest checkpoint;
                                                          interrupted runs resume when a worker of
                                                          their host starts: GRPO_RESUME_INTERRUPTED)

``starting``/``running``/``stopping`` mean a supervisor (a Celery task) owns the run and refreshes
``heartbeat_at``; a run in one of them whose heartbeat is stale lost its worker.
"""

from __future__ import annotations

import uuid

from django.conf import settings
from django.contrib.postgres.fields import ArrayField
from django.contrib.postgres.indexes import GinIndex
from django.db import models
from django.db.models import F, Func, Q, Value
from django.db.models.functions import Length
from django.db.models.lookups import Exact, LessThanOrEqual, Regex
from django.utils import timezone


class RunStatus(models.TextChoices):
    QUEUED = "queued"
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    COMPLETED = "completed"
    FAILED = "failed"
    STOPPED = "stopped"
    INTERRUPTED = "interrupted"


# A supervisor owns the run (and its processes) in these states.
ACTIVE_STATUSES = (RunStatus.STARTING, RunStatus.RUNNING, RunStatus.STOPPING)
# An attempt has ended in these states (``finished_at`` is set); the run may go on with a new attempt
# from the resumable ones.
TERMINAL_STATUSES = (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.STOPPED, RunStatus.INTERRUPTED)
RESUMABLE_STATUSES = (RunStatus.FAILED, RunStatus.STOPPED, RunStatus.INTERRUPTED)

# The database's ceilings for a run's tags and note; the settings GRPO_RUN_MAX_TAGS,
# GRPO_RUN_TAG_MAX_CHARS and GRPO_RUN_NOTE_MAX_CHARS set the (lower) limits the API enforces.
TAGS_CEILING = 64
TAG_CHARS_CEILING = 64
NOTE_CHARS_CEILING = 20_000


def _tags_joined() -> Func:
    """SQL ``array_to_string(tags, ',')``: the tags as one text, for CHECK constraints."""
    return Func(F("tags"), Value(","), function="array_to_string", output_field=models.TextField())


class Run(models.Model):
    """One training run: its RUN.yaml document, where it is in its life cycle, and its processes."""

    uid = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="runs")
    name = models.CharField(max_length=200)
    # Exactly the RUN.yaml document (trainer/config/run_config.py); frozen once launched (DB trigger).
    config = models.JSONField()
    config_sha256 = models.CharField(max_length=64)
    status = models.CharField(max_length=16, choices=RunStatus.choices, default=RunStatus.QUEUED)
    failure_reason = models.TextField(blank=True, default="")
    idempotency_key = models.CharField(max_length=255, blank=True, default="")

    created_at = models.DateTimeField(default=timezone.now)
    launched_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    heartbeat_at = models.DateTimeField(null=True, blank=True)

    # The current attempt (1 = first launch; each resume adds one).
    attempt = models.PositiveIntegerField(default=0)
    resumed_from = models.ForeignKey(
        "Checkpoint", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    celery_task_id = models.CharField(max_length=255, blank=True, default="")
    output_dir = models.CharField(max_length=1024, blank=True, default="")
    worker_host = models.CharField(max_length=255, blank=True, default="")
    # What the worker resolved hub ids to: {"model": {"id", "type", "revision", "commit", "path"},
    # "dataset": {...}} (the exact commits the run trained on).
    sources = models.JSONField(default=dict, blank=True)
    # Where the current attempt runs (set by the worker's claim; see controlplane/runs/placement.py):
    # {"host", "worker", "gpus": every GPU it holds, "vllm": {...}, "trainer": {..., "ranks": [...]}}.
    # A live run's GPUs are held by it: no other run on the host is placed on them.
    placement = models.JSONField(default=dict, blank=True)
    # Why a queued run is not placed yet ("waiting for 3 GPUs: 1 of 4 free on host-a").
    waiting_reason = models.CharField(max_length=500, blank=True, default="")
    vllm_port = models.PositiveIntegerField(null=True, blank=True)
    # Process-group ids (each child is the leader of its own group; see worker/guard.py).
    vllm_pid = models.IntegerField(null=True, blank=True)
    trainer_pid = models.IntegerField(null=True, blank=True)
    vllm_exit_code = models.IntegerField(null=True, blank=True)
    trainer_exit_code = models.IntegerField(null=True, blank=True)
    # The user's labels and free-text note (editable at any time, unlike the config).
    # text[], not varchar(64)[]: Django casts the value to the column's type, and a cast to varchar
    # cuts a long tag silently; run_tags_shape refuses it instead.
    tags = ArrayField(models.TextField(), default=list, blank=True)
    note = models.TextField(blank=True, default="")

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [
            models.Index(fields=["owner", "-created_at"], name="run_owner_created"),
            models.Index(fields=["status", "heartbeat_at"], name="run_status_heartbeat"),
            # ?tag= filters with tags @> ARRAY[...]
            GinIndex(fields=["tags"], name="run_tags_gin"),
        ]
        constraints = [
            # array_length of an empty array is NULL, which the CHECK lets through
            models.CheckConstraint(condition=Q(tags__len__lte=TAGS_CEILING), name="run_tags_count"),
            # each tag 1..TAG_CHARS_CEILING characters, no comma or white space (?tag=a,b lists
            # several), checked on the tags joined by commas
            models.CheckConstraint(
                condition=Regex(
                    _tags_joined(),
                    rf"^([^,[:space:]]{{1,{TAG_CHARS_CEILING}}}(,[^,[:space:]]{{1,{TAG_CHARS_CEILING}}})*)?$",
                ),
                name="run_tags_shape",
            ),
            # ... where a comma inside a tag would pass for two tags: splitting the joined text
            # again gives the array back only when no tag holds one
            models.CheckConstraint(
                condition=Exact(F("tags"), Func(_tags_joined(), Value(","), function="string_to_array")),
                name="run_tags_no_comma",
            ),
            models.CheckConstraint(
                condition=LessThanOrEqual(Length("note"), NOTE_CHARS_CEILING), name="run_note_length"
            ),
            models.CheckConstraint(condition=Q(status__in=RunStatus.values), name="run_status_valid"),
            models.CheckConstraint(
                condition=(
                    Q(status__in=TERMINAL_STATUSES, finished_at__isnull=False)
                    | (~Q(status__in=TERMINAL_STATUSES) & Q(finished_at__isnull=True))
                ),
                name="run_finished_at_iff_terminal",
            ),
            models.CheckConstraint(
                condition=~Q(status=RunStatus.FAILED) | ~Q(failure_reason=""),
                name="run_failed_has_reason",
            ),
            models.CheckConstraint(
                condition=~Q(status__in=ACTIVE_STATUSES)
                | (
                    Q(launched_at__isnull=False, heartbeat_at__isnull=False, attempt__gte=1)
                    & ~Q(worker_host="")
                ),
                name="run_active_is_claimed",
            ),
            models.CheckConstraint(condition=~Q(name=""), name="run_name_not_empty"),
            models.UniqueConstraint(
                fields=["owner", "idempotency_key"],
                condition=~Q(idempotency_key=""),
                name="run_idempotency_key_unique",
            ),
            # Two live runs on one worker host never share a vLLM port.
            models.UniqueConstraint(
                fields=["worker_host", "vllm_port"],
                condition=Q(status__in=ACTIVE_STATUSES),
                name="run_port_unique_while_active",
            ),
        ]

    def __str__(self) -> str:
        return f"run {self.pk} {self.name!r} ({self.status})"

    @property
    def is_active(self) -> bool:
        return self.status in ACTIVE_STATUSES

    @property
    def is_terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES


class MetricPoint(models.Model):
    """One metric value at one optimizer step (spec metric names, e.g. ``reward``)."""

    # No index of its own: (run, step) below serves the foreign key's lookups too.
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="metric_points", db_index=False)
    step = models.PositiveIntegerField()
    name = models.CharField(max_length=200)
    value = models.FloatField()  # Postgres double precision keeps NaN/inf as logged

    class Meta:
        indexes = [
            # A run's last step (the run list's progress, polled every few seconds for a page of
            # runs; the dashboard's snapshot) is one index entry, not a scan of all its points:
            # 5 runs x 40k points took 4.9 ms per run through the foreign key's index.
            models.Index(fields=["run", "-step"], name="metric_point_run_step"),
        ]
        constraints = [
            # (run, name, step) in this order: the unique index also serves per-name range reads
            # (WHERE run = ? AND name IN (...) AND step > ? ORDER BY step).
            models.UniqueConstraint(fields=["run", "name", "step"], name="metric_point_unique_run_name_step"),
        ]


class MetricStep(models.Model):
    """When a logging step was logged (the ``timestamp`` of its ``metrics.jsonl`` row, else the time
        it was stored) and by which attempt of the run: the dashboard's wall-time and relative-time axes
        and its resume markers (the first step of each attempt after the first). A re-logged step (a
        resumed attempt re-doing it) takes the newer time and attempt; an eval line (only ``eval/*``
    names, written after later steps' lines) leaves them."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="metric_steps", db_index=False)
    step = models.PositiveIntegerField()
    time = models.DateTimeField()
    attempt = models.PositiveIntegerField(default=1)

    class Meta:
        constraints = [
            # Also the index of the run's steps in order (the API's columns, since_step reads).
            models.UniqueConstraint(fields=["run", "step"], name="metric_step_unique_run_step"),
        ]

    def __str__(self) -> str:
        return f"step {self.step} of run {self.run_id} (attempt {self.attempt})"


class CompletionSplit(models.TextChoices):
    """Which pass sampled a completion: the training rollouts, or an evaluation on ``eval_dataset``
    (a ``completions.jsonl`` row with ``"eval": true``; scored with the weights of its step)."""

    TRAIN = "train"
    EVAL = "eval"


# A completion's fields: the API's rows and a download's columns, in CSV column order (``rewards``:
# per function, a JSON object; ``reference``: the dataset row's reference answer, "" when none;
# ``split``: train or eval, last so that the older columns keep their places).
COMPLETION_FIELDS = (
    "step",
    "index",
    "prompt",
    "completion",
    "reward",
    "rewards",
    "advantage",
    "group_id",
    "row_index",
    "reference",
    "split",
)


class CompletionSample(models.Model):
    """One sampled (prompt, completion) pair with its reward(s) and advantage."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="completion_samples")
    # Training rows and eval rows of one step are numbered apart (each from 0): (run, split, step, index).
    # db_default too: rows inserted without the column (bench/completions_query.py) are training rows.
    split = models.CharField(
        max_length=8,
        choices=CompletionSplit.choices,
        default=CompletionSplit.TRAIN,
        db_default=CompletionSplit.TRAIN,
    )
    step = models.PositiveIntegerField()
    index = models.PositiveIntegerField()  # position within the step's logged batch (of its split)
    prompt = models.TextField()
    completion = models.TextField()
    reward = models.FloatField(null=True, blank=True)
    rewards = models.JSONField(default=dict, blank=True)  # per reward function name
    advantage = models.FloatField(null=True, blank=True)
    group_id = models.BigIntegerField(null=True, blank=True)
    row_index = models.BigIntegerField(null=True, blank=True)
    # The dataset row's reference answer as the trainer logged it ("" when the row had none).
    reference = models.TextField(blank=True, default="")

    class Meta:
        ordering = ["step", "index"]
        constraints = [
            # Also the index of one split's steps (selectors.run_completion_steps' GROUP BY step).
            models.UniqueConstraint(
                fields=["run", "split", "step", "index"], name="completion_unique_run_split_step_index"
            ),
            models.CheckConstraint(
                condition=Q(split__in=CompletionSplit.values), name="completion_split_valid"
            ),
        ]
        indexes = [
            # The completions table's pages of groups (selectors.run_completion_groups): GROUP BY
            # (step, group_id) of one split in index order with the aggregated columns in the index
            # (index-only).
            models.Index(
                fields=["run", "split", "step", "group_id"],
                include=["reward", "advantage"],
                name="completion_split_step_group",
            ),
        ]


class Checkpoint(models.Model):
    """A checkpoint folder written by the trainer (``<output_dir>/checkpoint-<step>``)."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="checkpoints")
    step = models.PositiveIntegerField()
    path = models.CharField(max_length=1024)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["step"]
        constraints = [
            models.UniqueConstraint(fields=["run", "step"], name="checkpoint_unique_run_step"),
            models.CheckConstraint(condition=~Q(path=""), name="checkpoint_path_not_empty"),
        ]

    def __str__(self) -> str:
        return f"checkpoint {self.step} of run {self.run_id}"


class RunEventKind(models.TextChoices):
    STATUS = "status"
    LOG = "log"
    ERROR = "error"
    INFO = "info"


class RunNodeStatus(models.TextChoices):
    ASKED = "asked"  # the first host asked the node's worker to start its part
    RUNNING = "running"
    EXITED = "exited"  # its processes ended with exit_code 0
    FAILED = "failed"  # its processes ended otherwise, or could not start (reason)


class RunNode(models.Model):
    """One further host of an attempt of a trainer across hosts (``resources.trainer.nodes``): its
    worker's lease is the run's placement; this row is what that worker reports back (the first
    host's supervisor, which owns the run, reads it)."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="nodes")
    attempt = models.PositiveIntegerField()
    index = models.PositiveIntegerField()  # 1..nodes-1 (node 0 is the run's own host)
    host = models.CharField(max_length=255)
    worker = models.CharField(max_length=255)
    status = models.CharField(max_length=16, choices=RunNodeStatus.choices, default=RunNodeStatus.ASKED)
    asked_at = models.DateTimeField(default=timezone.now)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    pid = models.IntegerField(null=True, blank=True)
    exit_code = models.IntegerField(null=True, blank=True)
    reason = models.TextField(blank=True, default="")

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["run", "attempt", "index"], name="run_node_unique"),
            models.CheckConstraint(condition=Q(index__gte=1), name="run_node_index_from_1"),
        ]


class RunEvent(models.Model):
    """Something that happened to a run: a status change, a process start/exit, a log tail, an error."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="events")
    created_at = models.DateTimeField(default=timezone.now)
    kind = models.CharField(max_length=16, choices=RunEventKind.choices)
    message = models.TextField()

    class Meta:
        ordering = ["created_at", "id"]
        indexes = [models.Index(fields=["run", "created_at"], name="run_event_run_created")]
        constraints = [
            models.CheckConstraint(condition=Q(kind__in=RunEventKind.values), name="run_event_kind_valid"),
        ]


class WorkerHost(models.Model):
    """A Celery worker that supervises runs, as it announced itself on start (removed on shutdown):
    the queues (pools) it consumes and the GPUs it places runs on. The API checks a run's GPU request
    against the largest worker of its pool."""

    name = models.CharField(max_length=255, unique=True)  # Celery's node name, e.g. gpu@host-a
    host = models.CharField(max_length=255)
    queues = models.JSONField(default=list)
    gpus = models.JSONField(default=list)  # GPU ids as CUDA_VISIBLE_DEVICES names them
    cpus = models.PositiveIntegerField(default=1)
    started_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]
        constraints = [models.CheckConstraint(condition=~Q(name=""), name="worker_host_name_not_empty")]

    def __str__(self) -> str:
        return f"worker {self.name} ({len(self.gpus)} GPUs)"


class RunFileCursor(models.Model):
    """How far the supervisor has ingested one of a run's output files (``metrics.jsonl``,
    ``completions.jsonl``), saved in the transaction that stores the lines: a restarted worker
    resumes at ``offset`` and never stores a line twice or skips one."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="file_cursors")
    name = models.CharField(max_length=64)  # the file's name in the run's output folder
    offset = models.PositiveBigIntegerField(default=0)  # bytes: just past the last ingested line
    # completions only: the step of the block being read and its rows so far, so that a block split
    # across two reads continues its indices (a new attempt starts a new block); training rows here,
    # eval rows (``"eval": true``, numbered apart) in eval_step / eval_count, so that the two kinds
    # of rows may interleave in the file
    step = models.IntegerField(null=True, blank=True)
    count = models.PositiveIntegerField(default=0)
    eval_step = models.IntegerField(null=True, blank=True)
    eval_count = models.PositiveIntegerField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["run", "name"], name="run_file_cursor_unique_run_name")
        ]

    def __str__(self) -> str:
        return f"{self.name} of run {self.run_id} at byte {self.offset}"


class ChartPreference(models.Model):
    """A user's chart settings on the run pages: the metric names pinned at the top, in order
    (at most ``GRPO_MAX_PINNED_CHARTS``; the serializer checks). No row: the default pins."""

    user = models.OneToOneField(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="chart_preference"
    )
    pinned = ArrayField(models.CharField(max_length=200), default=list, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"chart preference of user {self.user_id}"
