"""DRF serializers (input validation for the API, output shapes for runs and their data), one module
per concern; every name is re-exported here, so callers keep ``controlplane.runs.serializers.<name>``
(DRF's ``DEFAULT_PARSER_CLASSES`` names ``SafeJSONParser`` so).

- :mod:`.runs`: creation, the list and its query, updates, one run's shape, events, checkpoints;
- :mod:`.compare`: the ids a comparison takes and what it answers;
- :mod:`.completions`: the completions query, rows, groups and rollouts, steps;
- :mod:`.metrics`: the series query and answer, pinned charts, the diagnosis;
- :mod:`.parsing`: bounded JSON bodies and YAML depth.
"""

from __future__ import annotations

from controlplane.runs.serializers.compare import (
    NO_RUNS_CHOSEN,
    CompareApiQuerySerializer,
    CompareOutputSerializer,
    CompareQuerySerializer,
    CompareRunSerializer,
    ConfigDiffRowSerializer,
)
from controlplane.runs.serializers.completions import (
    CompletionGroupSerializer,
    CompletionOutputSerializer,
    CompletionRolloutSerializer,
    CompletionsQuerySerializer,
    CompletionStepSerializer,
    CompletionStepsQuerySerializer,
    PageSizeField,
)
from controlplane.runs.serializers.metrics import (
    MAX_STEP,
    METRIC_NAME_MAX_CHARS,
    ChartPreferenceSerializer,
    DiagnosisOutputSerializer,
    MetricsOutputSerializer,
    MetricsQuerySerializer,
)
from controlplane.runs.serializers.parsing import (
    SafeJSONParser,
    yaml_depth_error,
)
from controlplane.runs.serializers.runs import (
    TAG_PATTERN,
    CheckpointOutputSerializer,
    EventOutputSerializer,
    EventsQuerySerializer,
    RunCreatedSerializer,
    RunCreateInputSerializer,
    RunListOutputSerializer,
    RunListQuerySerializer,
    RunOutputSerializer,
    RunUpdateInputSerializer,
    comma_list,
    run_created_payload,
)

__all__ = [
    "ChartPreferenceSerializer",
    "CheckpointOutputSerializer",
    "CompareApiQuerySerializer",
    "CompareOutputSerializer",
    "CompareQuerySerializer",
    "CompareRunSerializer",
    "CompletionGroupSerializer",
    "CompletionOutputSerializer",
    "CompletionRolloutSerializer",
    "CompletionStepSerializer",
    "CompletionStepsQuerySerializer",
    "CompletionsQuerySerializer",
    "ConfigDiffRowSerializer",
    "DiagnosisOutputSerializer",
    "EventOutputSerializer",
    "EventsQuerySerializer",
    "MAX_STEP",
    "METRIC_NAME_MAX_CHARS",
    "MetricsOutputSerializer",
    "MetricsQuerySerializer",
    "NO_RUNS_CHOSEN",
    "PageSizeField",
    "RunCreateInputSerializer",
    "RunCreatedSerializer",
    "RunListOutputSerializer",
    "RunListQuerySerializer",
    "RunOutputSerializer",
    "RunUpdateInputSerializer",
    "SafeJSONParser",
    "TAG_PATTERN",
    "comma_list",
    "run_created_payload",
    "yaml_depth_error",
]
