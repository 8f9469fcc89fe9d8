"""Reads (HackSoft's selectors), one module per concern; every name is re-exported here, so callers
keep ``from controlplane.runs import selectors`` and ``selectors.<name>``.

- :mod:`.runs`: which runs a user may see, their list, search and status, events;
- :mod:`.metrics`: a run's metric series and columns, latest values, download rows, diagnosis,
  the catalogue, pinned charts;
- :mod:`.compare`: runs to compare, the metrics to offer, the config diff;
- :mod:`.completions`: sampled completions, their groups and rollouts, download rows;
- :mod:`.outputs`: checkpoints and the ingest's file offsets;
- :mod:`.registry`: what a run may use (registries, the form's main args, dataset summaries).
"""

from __future__ import annotations

from controlplane.runs.models import COMPLETION_FIELDS  # the columns of the completion rows read here
from controlplane.runs.selectors.compare import (
    compare_default_metrics,
    compare_metric_choices,
    compare_runs_get,
    config_flatten,
    run_config_diff,
)
from controlplane.runs.selectors.completions import (
    COMPLETION_GROUP_FILTERS,
    COMPLETION_ORDERINGS,
    ZERO_ADVANTAGE_EPS,
    CompletionFilter,
    run_completion_group_rollouts,
    run_completion_groups,
    run_completion_list,
    run_completion_rows,
    run_completion_steps,
    run_has_eval,
)
from controlplane.runs.selectors.metrics import (
    DEFAULT_PINNED_CHARTS,
    chart_preference_get,
    metric_catalogue_get,
    metric_info,
    metric_names,
    run_diagnosis,
    run_metric_columns,
    run_metric_latest,
    run_metric_rows,
    run_metric_series,
    run_metric_step_columns,
)
from controlplane.runs.selectors.outputs import (
    checkpoint_owned_by_path,
    run_checkpoint_get,
    run_checkpoint_list,
    run_checkpoint_owned_get,
    run_checkpoint_steps,
    run_file_cursors,
)
from controlplane.runs.selectors.registry import (
    EVAL_ARGS,
    MAIN_ARGS,
    PREVIEW_ROWS,
    PREVIEW_TEXT_CHARS,
    REGISTRY_KEYS,
    dataset_summary,
    main_arg_defaults,
    registry_get,
)
from controlplane.runs.selectors.runs import (
    RUN_LIST_ORDERINGS,
    run_event_list,
    run_get,
    run_list,
    run_list_search,
    run_list_with_progress,
    run_max_steps,
    run_status_snapshot,
)

__all__ = [
    "COMPLETION_FIELDS",
    "COMPLETION_GROUP_FILTERS",
    "COMPLETION_ORDERINGS",
    "DEFAULT_PINNED_CHARTS",
    "EVAL_ARGS",
    "MAIN_ARGS",
    "PREVIEW_ROWS",
    "PREVIEW_TEXT_CHARS",
    "REGISTRY_KEYS",
    "RUN_LIST_ORDERINGS",
    "ZERO_ADVANTAGE_EPS",
    "CompletionFilter",
    "chart_preference_get",
    "checkpoint_owned_by_path",
    "compare_default_metrics",
    "compare_metric_choices",
    "compare_runs_get",
    "config_flatten",
    "dataset_summary",
    "main_arg_defaults",
    "metric_catalogue_get",
    "metric_info",
    "metric_names",
    "registry_get",
    "run_checkpoint_get",
    "run_checkpoint_list",
    "run_checkpoint_owned_get",
    "run_checkpoint_steps",
    "run_completion_group_rollouts",
    "run_completion_groups",
    "run_completion_list",
    "run_completion_rows",
    "run_completion_steps",
    "run_has_eval",
    "run_config_diff",
    "run_diagnosis",
    "run_event_list",
    "run_file_cursors",
    "run_get",
    "run_list",
    "run_list_search",
    "run_list_with_progress",
    "run_max_steps",
    "run_metric_columns",
    "run_metric_latest",
    "run_metric_rows",
    "run_metric_series",
    "run_metric_step_columns",
    "run_status_snapshot",
]
