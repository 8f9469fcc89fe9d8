"""The API reference page: the OpenAPI schema (drf-spectacular) rendered as HTML on our own page.

No Swagger UI or Redoc: their scripts come from a CDN, which the Content-Security-Policy forbids and
an offline install cannot reach. The page is served under the schema's own access rule
(``SPECTACULAR_SETTINGS['SERVE_PERMISSIONS']``: anyone in development, logged-in users in production
unless ``GRPO_PUBLIC_SCHEMA``).
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.generators import SchemaGenerator
from drf_spectacular.settings import spectacular_settings
from rest_framework.renderers import TemplateHTMLRenderer
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

METHODS = ("get", "post", "put", "patch", "delete")


class ApiReferenceView(APIView):
    """``GET /api/v1/docs/``: every endpoint with its parameters, request fields and responses."""

    renderer_classes = [TemplateHTMLRenderer]
    schema = None  # the page is not an API endpoint: keep it out of the schema it renders
    permission_classes = spectacular_settings.SERVE_PERMISSIONS
    authentication_classes = spectacular_settings.SERVE_AUTHENTICATION or APIView.authentication_classes

    def get(self, request: Request) -> Response:
        generator = SchemaGenerator()
        schema = generator.get_schema(request=request, public=spectacular_settings.SERVE_PUBLIC)
        return Response(
            {"info": schema.get("info", {}), "endpoints": api_endpoints(schema)},
            template_name="core/api_reference.html",
        )


def api_endpoints(schema: dict[str, Any]) -> list[dict[str, Any]]:
    """The schema's operations in path order: ``{method, path, summary, description, parameters,
    body_fields, responses}``, each parameter and body field ``{name, where, type, required, help}``."""
    components = schema.get("components", {}).get("schemas", {})
    endpoints = []
    for path, item in sorted(schema.get("paths", {}).items()):
        for method in METHODS:
            operation = item.get(method)
            if operation is None:
                continue
            parameters = [
                {
                    "name": p.get("name", ""),
                    "where": p.get("in", ""),
                    "type": _type_text(p.get("schema", {}), components),
                    "required": bool(p.get("required")),
                    "help": p.get("description", ""),
                }
                for p in operation.get("parameters", [])
            ]
            endpoints.append(
                {
                    "method": method.upper(),
                    "path": path,
                    "anchor": f"{method}-{path}".replace("/", "-").replace("{", "").replace("}", ""),
                    "summary": operation.get("summary", ""),
                    "description": operation.get("description", ""),
                    "parameters": parameters,
                    "body_fields": _body_fields(operation.get("requestBody"), components),
                    "responses": [
                        {"status": status, "help": (response or {}).get("description", "")}
                        for status, response in sorted(operation.get("responses", {}).items())
                    ],
                }
            )
    return endpoints


def _resolve(node: dict[str, Any], components: dict[str, Any]) -> dict[str, Any]:
    ref = node.get("$ref", "")
    return components.get(ref.rsplit("/", 1)[-1], {}) if ref else node


def _type_text(node: dict[str, Any], components: dict[str, Any]) -> str:
    if "$ref" in node:
        return node["$ref"].rsplit("/", 1)[-1]
    if node.get("type") == "array":
        return f"list of {_type_text(node.get('items', {}), components)}"
    if "enum" in node:
        return " | ".join(str(v) for v in node["enum"])
    return str(node.get("type") or "any")


def _body_fields(body: dict[str, Any] | None, components: dict[str, Any]) -> list[dict[str, Any]]:
    """The fields of the JSON request body (its first content type), one level deep."""
    if not body:
        return []
    content = body.get("content", {})
    media = content.get("application/json") or next(iter(content.values()), {})
    node = _resolve(media.get("schema", {}), components)
    required = set(node.get("required", []))
    return [
        {
            "name": name,
            "where": "body",
            "type": _type_text(field, components),
            "required": name in required,
            "help": field.get("description", ""),
        }
        for name, field in node.get("properties", {}).items()
    ]
