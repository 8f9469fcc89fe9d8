"""REST API v1 (token auth, JSON): thin views over services and selectors.

``POST /runs/`` creates and launches (``Idempotency-Key`` makes retries safe); ``stop`` and
``resume`` answer 202 (the supervisor acts on them) or 409 when the run's status forbids it.
Users see only their own runs (404 otherwise); staff see all.
"""

from __future__ import annotations

from django.conf import settings
from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import serializers, status
from rest_framework.exceptions import NotFound, PermissionDenied, ValidationError
from rest_framework.pagination import PageNumberPagination
from rest_framework.renderers import JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.throttling import UserRateThrottle
from rest_framework.views import APIView

from controlplane.runs import downloads, selectors, services
from controlplane.runs.serializers import (
    ChartPreferenceSerializer,
    CheckpointOutputSerializer,
    CompareApiQuerySerializer,
    CompareOutputSerializer,
    CompareRunSerializer,
    CompletionGroupSerializer,
    CompletionOutputSerializer,
    CompletionsQuerySerializer,
    CompletionStepSerializer,
    CompletionStepsQuerySerializer,
    DiagnosisOutputSerializer,
    EventOutputSerializer,
    EventsQuerySerializer,
    MetricsOutputSerializer,
    MetricsQuerySerializer,
    RunCreatedSerializer,
    RunCreateInputSerializer,
    RunListOutputSerializer,
    RunListQuerySerializer,
    RunOutputSerializer,
    RunUpdateInputSerializer,
    run_created_payload,
)
from trainer.config.run_config import RunConfigError
from trainer.plugins import registry

ConflictSerializer = inline_serializer("Conflict", {"detail": serializers.CharField()})


class PageSizePagination(PageNumberPagination):
    """``?page=N&page_size=M`` (M up to 1000; default PAGE_SIZE)."""

    page_size_query_param = "page_size"
    max_page_size = 1000


class RunListPagination(PageSizePagination):
    """The run list's pages: ``GRPO_RUN_LIST_PAGE_SIZE`` runs unless ``page_size`` says otherwise
    (read per request, like the page's own paginator)."""

    @property
    def page_size(self) -> int:  # type: ignore[override]
        return settings.GRPO_RUN_LIST_PAGE_SIZE


FORMAT_PARAMETER = OpenApiParameter(
    "format",
    str,
    enum=list(downloads.FORMATS),
    description="download everything matching as a streamed CSV or JSON attachment instead of the "
    "JSON answer (no pagination)",
)


# ``?format=csv|json`` asks for a download, not for one of DRF's renderers: without this DRF
# answers 404 to ``format=csv`` (no renderer of that name). Errors are still rendered as JSON.
# (A comment, not a docstring: the OpenAPI schema would show a docstring as the views' description.)
class DownloadNegotiationMixin:
    def perform_content_negotiation(self, request, force=False):
        if request.query_params.get("format") in downloads.FORMATS:
            return (JSONRenderer(), JSONRenderer.media_type)
        return super().perform_content_negotiation(request, force=force)


def _download_format(request: Request) -> str | None:
    fmt = request.query_params.get("format")
    return fmt if fmt in downloads.FORMATS else None


def _conflict(exc: Exception) -> Response:
    return Response({"detail": str(exc)}, status=status.HTTP_409_CONFLICT)


class RegistryApi(APIView):
    @extend_schema(
        summary="Registered models, datasets, reward functions, tools, environments, rollout loops: each with its origin, docs (rewards: the columns read), broken ones with their error; main defaults",
        responses=inline_serializer(
            "Registry",
            {
                k: serializers.DictField()
                for k in (
                    "models",
                    "datasets",
                    "reward_funcs",
                    "tools",
                    "environments",
                    "rollout_loops",
                    "plugin_errors",
                    "main_args",
                )
            },
        ),
    )
    def get(self, request: Request) -> Response:
        return Response(selectors.registry_get())


class MetricCatalogueApi(APIView):
    @extend_schema(
        summary="Every metric the trainer logs: name (or pattern such as rewards/{name}/mean), window reduction, unit, namespace, help text, when it is logged; the namespaces in reading order",
        responses=inline_serializer(
            "MetricCatalogue",
            {
                "namespaces": serializers.ListField(child=serializers.CharField()),
                "metrics": serializers.ListField(child=serializers.DictField()),
            },
        ),
    )
    def get(self, request: Request) -> Response:
        return Response(selectors.metric_catalogue_get())


class RegistryDatasetApi(APIView):
    @extend_schema(
        summary="A registered dataset's columns, row count and first rows (what the form previews)",
        responses=inline_serializer(
            "DatasetSummary",
            {
                "columns": serializers.ListField(child=serializers.CharField()),
                "rows": serializers.ListField(child=serializers.DictField()),
                "num_rows": serializers.IntegerField(),
            },
        ),
    )
    def get(self, request: Request, name: str) -> Response:
        if not registry.is_registered("dataset", name):
            return Response(
                {"detail": f"{name!r} is not a registered dataset"}, status=status.HTTP_404_NOT_FOUND
            )
        try:
            return Response(selectors.dataset_summary(name=name))
        except ValueError as exc:
            return Response({"detail": f"{name!r} {exc}"}, status=status.HTTP_422_UNPROCESSABLE_ENTITY)


class RunCreateThrottle(UserRateThrottle):
    """Run creations per user: ``GRPO_RUN_CREATE_RATE`` (read per request, so settings apply live)."""

    scope = "run_create"

    def get_rate(self) -> str:
        return settings.GRPO_RUN_CREATE_RATE


class RunListCreateApi(APIView):
    def get_throttles(self):
        return [RunCreateThrottle()] if self.request.method == "POST" else []

    @extend_schema(
        summary="List visible runs (newest first), filtered, searched and sorted on the server; "
        "each with its step / max_steps (what a list page polls)",
        parameters=[RunListQuerySerializer],
        responses=RunListOutputSerializer(many=True),
    )
    def get(self, request: Request) -> Response:
        services.runs_fail_stale()
        query = RunListQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        paginator = RunListPagination()
        runs = selectors.run_list_search(user=request.user, **query.filters())
        page = paginator.paginate_queryset(runs, request, view=self)
        data = RunListOutputSerializer(page, many=True, context={"request": request}).data
        return paginator.get_paginated_response(data)

    @extend_schema(
        summary="Create and launch a run",
        request=RunCreateInputSerializer,
        parameters=[
            OpenApiParameter(
                "Idempotency-Key",
                str,
                OpenApiParameter.HEADER,
                description="a retry with the same key returns the run the first request created",
            )
        ],
        responses={201: RunCreatedSerializer, 409: ConflictSerializer},
    )
    def post(self, request: Request) -> Response:
        key = request.headers.get("Idempotency-Key", "")
        if "\x00" in key or len(key) > 255:
            raise ValidationError({"Idempotency-Key": "at most 255 characters, no NUL characters"})
        serializer = RunCreateInputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        try:
            run, created = services.run_create(
                owner=request.user,
                name=serializer.validated_data["name"],
                config=serializer.validated_data["config"],
                idempotency_key=key,
            )
        except RunConfigError as exc:
            raise ValidationError({"config": exc.errors}) from None
        except services.IdempotencyKeyReused as exc:
            return _conflict(exc)
        except services.QueuedRunsLimit as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_429_TOO_MANY_REQUESTS)
        except services.RunCreateRateLimit as exc:
            return Response(
                {"detail": str(exc)},
                status=status.HTTP_429_TOO_MANY_REQUESTS,
                headers={"Retry-After": str(exc.retry_after_s)},
            )
        response = Response(run_created_payload(run, request), status=status.HTTP_201_CREATED)
        if not created:
            response["Idempotent-Replayed"] = "true"
        return response


class RunCompareApi(APIView):
    @extend_schema(
        summary="Several runs side by side: each run (id, name, owner, status) and their documents' "
        "config diff, one row per dotted key with a value per run and whether they differ",
        parameters=[CompareApiQuerySerializer],
        responses=CompareOutputSerializer,
    )
    def get(self, request: Request) -> Response:
        query = CompareApiQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        runs, missing = selectors.compare_runs_get(user=request.user, ids=query.validated_data["ids"])
        if missing:  # absent and someone else's read the same: nothing leaks
            raise NotFound(f"run {missing[0]} not found")
        return Response(
            {
                "runs": CompareRunSerializer(runs, many=True, context={"request": request}).data,
                "diff": selectors.run_config_diff(runs=runs),
            }
        )


class RunDetailApi(APIView):
    @extend_schema(summary="One run", responses=RunOutputSerializer)
    def get(self, request: Request, run_id: int) -> Response:
        services.runs_fail_stale()
        run = selectors.run_get(user=request.user, run_id=run_id)
        return Response(RunOutputSerializer(run, context={"request": request}).data)

    @extend_schema(
        summary="Edit a run's tags and/or note (its owner only; anything else is read-only)",
        request=RunUpdateInputSerializer,
        responses=RunOutputSerializer,
    )
    def patch(self, request: Request, run_id: int) -> Response:
        run = selectors.run_get(user=request.user, run_id=run_id)
        if run.owner_id != request.user.pk:  # staff see every run but edit only their own
            raise PermissionDenied("only the run's owner may edit its tags and note")
        data = RunUpdateInputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        run = services.run_annotations_update(run=run, **data.validated_data)
        return Response(RunOutputSerializer(run, context={"request": request}).data)


class RunStopApi(APIView):
    @extend_schema(
        summary="Stop a run (cooperative)",
        request=None,
        responses={202: RunCreatedSerializer, 409: ConflictSerializer},
    )
    def post(self, request: Request, run_id: int) -> Response:
        run = selectors.run_get(user=request.user, run_id=run_id)
        try:
            run = services.run_stop(run=run)
        except services.RunStateError as exc:
            return _conflict(exc)
        return Response(run_created_payload(run, request), status=status.HTTP_202_ACCEPTED)


class RunResumeApi(APIView):
    @extend_schema(
        summary="Resume a failed or stopped run from its latest checkpoint",
        request=None,
        responses={202: RunCreatedSerializer, 409: ConflictSerializer},
    )
    def post(self, request: Request, run_id: int) -> Response:
        run = selectors.run_get(user=request.user, run_id=run_id)
        try:
            run = services.run_resume(run=run)
        except services.RunStateError as exc:
            return _conflict(exc)
        return Response(run_created_payload(run, request), status=status.HTTP_202_ACCEPTED)


class RunMetricsApi(DownloadNegotiationMixin, APIView):
    @extend_schema(
        summary="Metric series by name; with ?format=csv|json a download, one row per step "
        "(CSV: step, then a column per metric)",
        parameters=[MetricsQuerySerializer, FORMAT_PARAMETER],
        responses=MetricsOutputSerializer,
    )
    def get(self, request: Request, run_id: int) -> Response:
        run = selectors.run_get(user=request.user, run_id=run_id)
        query = MetricsQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        fmt = _download_format(request)
        if fmt:
            columns, rows = selectors.run_metric_rows(
                run=run,
                names=query.validated_data.get("names") or None,
                since_step=query.validated_data.get("since_step"),
            )
            return downloads.download_response(
                request=request._request,
                pieces=downloads.metrics_pieces(fmt=fmt, columns=columns, rows=rows),
                fmt=fmt,
                filename=f"run-{run.pk}-metrics.{fmt}",
            )
        select = (
            selectors.run_metric_columns
            if query.validated_data["layout"] == "columns"
            else selectors.run_metric_series
        )
        series = select(
            run=run,
            names=query.validated_data.get("names") or None,
            since_step=query.validated_data.get("since_step"),
        )
        if query.validated_data["layout"] != "columns":
            return Response({"series": series})
        steps = selectors.run_metric_step_columns(run=run, since_step=query.validated_data.get("since_step"))
        return Response({"series": series, "steps": steps})


class CompletionGroupPagination(PageSizePagination):
    """``?by=group`` pages: ``GRPO_COMPLETION_GROUPS_PAGE_SIZE`` groups unless ``page_size`` says
    otherwise (the query serializer refused more than ``GRPO_COMPLETION_GROUPS_MAX_PAGE_SIZE``)."""

    @property
    def page_size(self) -> int:  # type: ignore[override]
        return settings.GRPO_COMPLETION_GROUPS_PAGE_SIZE

    @property
    def max_page_size(self) -> int:  # type: ignore[override]
        return settings.GRPO_COMPLETION_GROUPS_MAX_PAGE_SIZE


class RunCompletionsApi(DownloadNegotiationMixin, APIView):
    @extend_schema(
        summary="Sampled completions of one split (training by default; ?split=eval: the ones scored on "
        "eval_dataset) (newest step first, paginated), filtered (q, reward range, group, "
        "mixed or zero-advantage groups) and sorted on the server; ?by=group pages whole groups, each "
        "with all its rollouts (CompletionGroup). With ?format=csv|json every matching sample as a "
        "download, oldest step first",
        parameters=[CompletionsQuerySerializer, FORMAT_PARAMETER],
        responses=CompletionOutputSerializer(many=True),
    )
    def get(self, request: Request, run_id: int) -> Response:
        run = selectors.run_get(user=request.user, run_id=run_id)
        query = CompletionsQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        filters = query.filters()
        ordering = query.validated_data["ordering"]
        fmt = _download_format(request)
        if fmt:
            return downloads.download_response(
                request=request._request,
                pieces=downloads.completions_pieces(
                    fmt=fmt,
                    fields=selectors.COMPLETION_FIELDS,
                    rows=selectors.run_completion_rows(run=run, filters=filters),
                ),
                fmt=fmt,
                filename=f"run-{run.pk}-{'' if filters.split == 'train' else 'eval-'}completions.{fmt}",
            )
        if query.validated_data["by"] == "group":
            paginator = CompletionGroupPagination()
            page = paginator.paginate_queryset(
                selectors.run_completion_groups(run=run, filters=filters, ordering=ordering),
                request,
                view=self,
            )
            groups = selectors.run_completion_group_rollouts(
                run=run,
                groups=list(page),
                filters=filters,
                ordering=ordering,
            )
            return paginator.get_paginated_response(CompletionGroupSerializer(groups, many=True).data)
        paginator = PageSizePagination()
        page = paginator.paginate_queryset(
            selectors.run_completion_list(run=run, filters=filters, ordering=ordering), request, view=self
        )
        return paginator.get_paginated_response(CompletionOutputSerializer(page, many=True).data)


class RunCompletionStepsApi(APIView):
    @extend_schema(
        summary="Every step that has sampled completions of one split (?split=train|eval, default "
        "train), newest first, with its sample count (the run page's step picker)",
        parameters=[CompletionStepsQuerySerializer],
        responses=inline_serializer("CompletionSteps", {"steps": CompletionStepSerializer(many=True)}),
    )
    def get(self, request: Request, run_id: int) -> Response:
        run = selectors.run_get(user=request.user, run_id=run_id)
        query = CompletionStepsQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        steps = selectors.run_completion_steps(run=run, split=query.validated_data["split"])
        return Response({"steps": CompletionStepSerializer(steps, many=True).data})


class RunEventsApi(APIView):
    @extend_schema(
        summary="The run's latest events (status changes, process exits, log tails), oldest first",
        parameters=[EventsQuerySerializer],
        responses=EventOutputSerializer(many=True),
    )
    def get(self, request: Request, run_id: int) -> Response:
        run = selectors.run_get(user=request.user, run_id=run_id)
        query = EventsQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        events = selectors.run_event_list(
            run=run,
            after_id=query.validated_data.get("after_id"),
            kind=query.validated_data.get("kind"),
            q=query.validated_data.get("q"),
        )
        return Response(EventOutputSerializer(events, many=True).data)


class RunCheckpointsApi(APIView):
    @extend_schema(summary="Checkpoints the trainer saved", responses=CheckpointOutputSerializer(many=True))
    def get(self, request: Request, run_id: int) -> Response:
        run = selectors.run_get(user=request.user, run_id=run_id)
        return Response(CheckpointOutputSerializer(selectors.run_checkpoint_list(run=run), many=True).data)


class RunCheckpointDownloadApi(APIView):
    @extend_schema(
        summary="One checkpoint folder as a streamed tar (the run's owner only)",
        responses={(200, "application/x-tar"): bytes},
    )
    def get(self, request: Request, run_id: int, step: int):
        return downloads.checkpoint_owned_response(
            request=request._request, user=request.user, run_id=run_id, step=step
        )


class RunDiagnosisApi(APIView):
    @extend_schema(
        summary="The spec's diagnoses (bottleneck, concurrency, saturation, duplicates, clipping) "
        "applied to the run's latest steps, each with its numbers and advice",
        responses=DiagnosisOutputSerializer(many=True),
    )
    def get(self, request: Request, run_id: int) -> Response:
        run = selectors.run_get(user=request.user, run_id=run_id)
        return Response(DiagnosisOutputSerializer(selectors.run_diagnosis(run=run), many=True).data)


class ChartPreferenceApi(APIView):
    """The signed-in user's own chart settings (every user has one; nothing of anyone else's)."""

    @extend_schema(
        summary="Your pinned charts (the default pins until you save some)",
        responses=ChartPreferenceSerializer,
    )
    def get(self, request: Request) -> Response:
        return Response(selectors.chart_preference_get(user=request.user))

    @extend_schema(
        summary="Replace your pinned charts (metric names, in order)",
        request=ChartPreferenceSerializer,
        responses=ChartPreferenceSerializer,
    )
    def put(self, request: Request) -> Response:
        data = ChartPreferenceSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        services.chart_preference_update(user=request.user, pinned=data.validated_data["pinned"])
        return Response(selectors.chart_preference_get(user=request.user))
