from django.apps import AppConfig


class RunsConfig(AppConfig):
    name = "controlplane.runs"
    label = "runs"
    verbose_name = "Training runs"
    default_auto_field = "django.db.models.BigAutoField"
