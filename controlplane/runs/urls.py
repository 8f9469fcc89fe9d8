"""URL patterns: ``web_patterns`` (namespace ``runs``, under /runs/) and ``api_patterns``
(namespace ``runs-api``, under /api/v1/)."""

from __future__ import annotations

from django.urls import path

from controlplane.access.views import RateLimitedLoginView
from controlplane.runs import api, views

web_patterns = [
    path("", views.run_list_view, name="list"),
    path("new/", views.run_create_view, name="create"),
    path("login/", RateLimitedLoginView.as_view(), name="login"),
    path("compare/", views.run_compare_view, name="compare"),
    path("<int:run_id>/", views.run_detail_view, name="detail"),
    path("<int:run_id>/stop/", views.run_stop_view, name="stop"),
    path("<int:run_id>/resume/", views.run_resume_view, name="resume"),
    path(
        "<int:run_id>/checkpoints/<int:step>/download/",
        views.run_checkpoint_download_view,
        name="checkpoint-download",
    ),
]

api_patterns = [
    path("registry/", api.RegistryApi.as_view(), name="registry"),
    path("registry/datasets/<str:name>/", api.RegistryDatasetApi.as_view(), name="registry-dataset"),
    path("metrics/catalogue/", api.MetricCatalogueApi.as_view(), name="metric-catalogue"),
    path("runs/", api.RunListCreateApi.as_view(), name="run-list"),
    path("runs/compare/", api.RunCompareApi.as_view(), name="run-compare"),
    path("runs/<int:run_id>/", api.RunDetailApi.as_view(), name="run-detail"),
    path("runs/<int:run_id>/stop/", api.RunStopApi.as_view(), name="run-stop"),
    path("runs/<int:run_id>/resume/", api.RunResumeApi.as_view(), name="run-resume"),
    path("runs/<int:run_id>/metrics/", api.RunMetricsApi.as_view(), name="run-metrics"),
    path("runs/<int:run_id>/completions/", api.RunCompletionsApi.as_view(), name="run-completions"),
    path(
        "runs/<int:run_id>/completions/steps/",
        api.RunCompletionStepsApi.as_view(),
        name="run-completion-steps",
    ),
    path("runs/<int:run_id>/events/", api.RunEventsApi.as_view(), name="run-events"),
    path("runs/<int:run_id>/checkpoints/", api.RunCheckpointsApi.as_view(), name="run-checkpoints"),
    path(
        "runs/<int:run_id>/checkpoints/<int:step>/download/",
        api.RunCheckpointDownloadApi.as_view(),
        name="run-checkpoint-download",
    ),
    path("runs/<int:run_id>/diagnosis/", api.RunDiagnosisApi.as_view(), name="run-diagnosis"),
    path("preferences/charts/", api.ChartPreferenceApi.as_view(), name="chart-preferences"),
]
