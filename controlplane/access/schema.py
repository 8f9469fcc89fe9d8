"""OpenAPI description of the token scheme (drf-spectacular finds it through AccessConfig.ready)."""

from __future__ import annotations

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class ApiTokenScheme(OpenApiAuthenticationExtension):
    target_class = "controlplane.access.authentication.ApiTokenAuthentication"
    name = "tokenAuth"

    def get_security_definition(self, auto_schema):
        return {
            "type": "apiKey",
            "in": "header",
            "name": "Authorization",
            "description": "`Authorization: Token <key>`; issue one with `python manage.py issue_token USERNAME`",
        }
