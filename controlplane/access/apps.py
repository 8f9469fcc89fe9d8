from django.apps import AppConfig


class AccessConfig(AppConfig):
    name = "controlplane.access"
    label = "access"
    verbose_name = "Access: API tokens and login limits"

    def ready(self) -> None:
        from controlplane.access import schema  # noqa: F401  (registers the OpenAPI token scheme)
