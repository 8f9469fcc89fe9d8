"""Admin: read-mostly views of runs and their data (changes go through services, not the admin)."""

from __future__ import annotations

from django.contrib import admin

from controlplane.runs.models import Checkpoint, CompletionSample, MetricPoint, Run, RunEvent


class RunEventInline(admin.TabularInline):
    model = RunEvent
    extra = 0
    can_delete = False
    readonly_fields = ("created_at", "kind", "message")


@admin.register(Run)
class RunAdmin(admin.ModelAdmin):
    list_display = ("id", "name", "owner", "status", "attempt", "worker_host", "vllm_port", "created_at")
    list_filter = ("status",)
    search_fields = ("name", "owner__username")
    readonly_fields = [f.name for f in Run._meta.fields]
    inlines = [RunEventInline]


@admin.register(MetricPoint)
class MetricPointAdmin(admin.ModelAdmin):
    list_display = ("run", "step", "name", "value")
    list_filter = ("name",)
    raw_id_fields = ("run",)


@admin.register(CompletionSample)
class CompletionSampleAdmin(admin.ModelAdmin):
    list_display = ("run", "split", "step", "index", "reward", "advantage")
    list_filter = ("split",)
    raw_id_fields = ("run",)


@admin.register(Checkpoint)
class CheckpointAdmin(admin.ModelAdmin):
    list_display = ("run", "step", "path", "created_at")
    raw_id_fields = ("run",)
