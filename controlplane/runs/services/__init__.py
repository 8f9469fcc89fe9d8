"""Everything that writes runs (HackSoft style: keyword-only, typed functions named
``<entity>_<action>``), by sub-domain:

* :mod:`.lifecycle`: create (the one validation of a document), launch (enqueued by task name),
  stop, resume; what the supervisor records; stale runs failed; events.
* :mod:`.claim`: a worker claiming a queued run, with its placement leased under a lock.
* :mod:`.nodes`: a trainer across hosts: each further host's part asked for and reported on.
* :mod:`.ingest`: what the supervisor reads from the run's output folder (metrics, completions,
  checkpoints, file offsets), stored idempotently and published.
* :mod:`.stream`: the run's channel-layer group (``run-<id>``) and what is published to it.
* :mod:`.demo`: the demo run ``make run`` starts.
* :mod:`.annotations`: a run's tags and note, written by its owner.
* :mod:`.preferences`: a user's chart settings (pinned charts).

The names callers use are re-exported here (``services.run_create``); the modules are the rooms.
"""

from controlplane.access.services import token_issue
from controlplane.runs.services import ingest
from controlplane.runs.services.annotations import run_annotations_update
from controlplane.runs.services.claim import PlacementWait, placement_text, run_claim
from controlplane.runs.services.demo import demo_config, demo_run_start
from controlplane.runs.services.lifecycle import (
    MAX_EVENT_CHARS,
    SUPERVISE_TASK,
    IdempotencyKeyReused,
    QueuedRunsLimit,
    RunCreateRateLimit,
    RunStateError,
    run_config_validate,
    run_create,
    run_event_create,
    run_finish,
    run_heartbeat,
    run_launch,
    run_mark_running,
    run_placement_record,
    run_processes_record,
    run_queue,
    run_resume,
    run_sources_record,
    run_status_transition,
    run_stop,
    runs_fail_stale,
    runs_resume_interrupted,
)
from controlplane.runs.services.nodes import (
    NODE_TASK,
    NodeProblem,
    run_node_begin,
    run_node_end,
    run_node_heartbeat,
    run_node_problem,
    run_nodes_ask,
    run_nodes_ended,
)
from controlplane.runs.services.preferences import chart_preference_update
from controlplane.runs.services.stream import (
    MAX_PUBLISHED_TEXT_CHARS,
    run_group,
    run_message_publish,
    run_message_publish_on_commit,
    run_status_publish,
)

__all__ = [
    "NODE_TASK",
    "NodeProblem",
    "run_node_begin",
    "run_node_end",
    "run_node_heartbeat",
    "run_node_problem",
    "run_nodes_ask",
    "run_nodes_ended",
    "chart_preference_update",
    "MAX_EVENT_CHARS",
    "MAX_PUBLISHED_TEXT_CHARS",
    "SUPERVISE_TASK",
    "IdempotencyKeyReused",
    "PlacementWait",
    "QueuedRunsLimit",
    "RunCreateRateLimit",
    "RunStateError",
    "demo_config",
    "demo_run_start",
    "ingest",
    "placement_text",
    "run_annotations_update",
    "run_claim",
    "run_config_validate",
    "run_create",
    "run_event_create",
    "run_finish",
    "run_group",
    "run_heartbeat",
    "run_launch",
    "run_mark_running",
    "run_message_publish",
    "run_message_publish_on_commit",
    "run_placement_record",
    "run_processes_record",
    "run_queue",
    "run_resume",
    "run_sources_record",
    "run_status_publish",
    "run_status_transition",
    "run_stop",
    "runs_fail_stale",
    "runs_resume_interrupted",
    "token_issue",
]
