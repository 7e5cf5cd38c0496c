"""/openapi.json as afd serves it: the status codes the routes really answer, and streams described the
way OpenAPI 3.1 tools read a text/event-stream schema."""

from __future__ import annotations

from fastapi import FastAPI

SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "description": "One server-sent event: `data` is a JSON chunk of the response, or `[DONE]` at the end.",
    "properties": {
        "data": {"type": "string"},
        "event": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
}
"""How OpenAPI 3.1 tools (schemathesis among them) read a text/event-stream schema: one parsed event."""


def openapi_schema(app: FastAPI) -> dict:
    """FastAPI documents 422 for body errors; this server answers them 400 with vLLM's error body."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        error = {
            "description": "Error",
            "content": {
                "application/json": {
                    "schema": {
                        "type": "object",
                        "required": ["error"],
                        "properties": {
                            "error": {
                                "type": "object",
                                "properties": {
                                    "message": {"type": "string"},
                                    "type": {"type": "string"},
                                    "param": {"type": ["string", "null"]},
                                    "code": {"type": "integer"},
                                },
                            }
                        },
                    }
                }
            },
        }
        paths = schema.get("paths", {})
        probe = {
            "200": {"description": "Serving (empty body)"},
            "503": {"description": "Not ready, draining or a peer is dead"},
        }
        paths["/health"]["get"]["responses"] = dict(probe)
        for method in ("get", "post"):
            paths["/ping"][method]["responses"] = dict(probe)
        paths["/metrics"]["get"]["responses"] = {
            "200": {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}
        }
        for path, ops in paths.items():
            for op in ops.values():
                responses = op.setdefault("responses", {})
                responses.pop("422", None)
                if op.get("requestBody"):
                    codes = (
                        ("400", "401", "404", "413", "500", "503")
                        if path.startswith("/v1/")
                        else ("400", "404", "413", "500")
                    )
                    for code in codes:
                        responses[code] = error
                if path.startswith("/v1/") and op.get("requestBody"):  # `stream: true` answers server-sent events
                    responses["200"].setdefault("content", {})["text/event-stream"] = {"schema": SSE_EVENT}
        schema.get("components", {}).get("schemas", {}).pop("HTTPValidationError", None)
        schema.get("components", {}).get("schemas", {}).pop("ValidationError", None)
        app.openapi_schema = schema
    return app.openapi_schema
