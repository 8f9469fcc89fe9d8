from django.contrib import admin
from django.utils import timezone

from controlplane.access.models import ApiToken


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    list_display = ("prefix", "user", "name", "created_at", "last_used_at", "revoked_at")
    list_filter = ("revoked_at",)
    search_fields = ("prefix", "user__username", "name")
    readonly_fields = ("key_sha256", "prefix", "created_at", "last_used_at")
    actions = ["revoke"]

    @admin.action(description="Revoke the selected tokens")
    def revoke(self, request, queryset):
        queryset.filter(revoked_at__isnull=True).update(revoked_at=timezone.now())

    def has_add_permission(self, request) -> bool:
        return False  # keys are issued by `manage.py issue_token` (shown once)
