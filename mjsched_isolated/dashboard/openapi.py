"""The JSON API's OpenAPI 3.0 description (``/api/openapi.json``), written by hand: the routes are few,
and a schema that says exactly what the handlers accept lets schemathesis fuzz them against it."""

from __future__ import annotations

from typing import Any

from mjsched_isolated._version import __version__
from mjsched_isolated.enums import ConcurrencyMode, JobStatus, RunStatus, values
from mjsched_isolated.planner import MAX_QUEUED


def _q(name: str, schema: dict[str, Any], text: str) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "schema": schema, "description": text}


NAME = {"name": "name", "in": "path", "required": True, "schema": {"type": "string", "minLength": 1,
                                                                   "maxLength": 200, "pattern": "^[^/]+$"}}
LIMIT = _q("limit", {"type": "integer", "minimum": 1, "maximum": 500}, "page size (default 50)")
BEFORE = _q("before", {"type": "integer", "minimum": 1}, "keyset: only ids below this (the previous page's "
                                                           "next_before)")
RUN_ID = {"name": "run_id", "in": "path", "required": True, "schema": {"type": "integer", "minimum": 1}}
OBJECT = {"type": "object"}
ERROR = {"description": "one line naming the field", "content": {"application/json": {"schema": {
    "type": "object", "properties": {"error": {"type": "string"}}, "required": ["error"]}}}}


def _ok(text: str, status: str = "200") -> dict[str, Any]:
    return {status: {"description": text, "content": {"application/json": {"schema": OBJECT}}},
            "400": ERROR, "401": ERROR, "403": ERROR, "404": ERROR}


def _get(summary: str, params: list[dict[str, Any]]) -> dict[str, Any]:
    return {"get": {"summary": summary, "parameters": params, "responses": _ok(summary)}}


def _post(summary: str, *, body: dict[str, Any] | None = None, status: str = "200") -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "parameters": [NAME], "responses": {**_ok(summary, status),
                                                                                  "409": ERROR}}
    if body is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    return {"post": op}


EDIT = {"type": "object", "additionalProperties": False, "minProperties": 1, "properties": {
    "cron_expression": {"type": "string"}, "timezone": {"type": "string"}, "description": {"type": "string"},
    "configuration": {"type": "object"}, "concurrency_mode": {"type": "string", "enum": list(values(ConcurrencyMode))},
    "max_queued": {"type": "integer", "minimum": 1, "maximum": MAX_QUEUED},
    "max_runtime_minutes": {"type": "integer", "minimum": 1}}}


BACKFILL = {"type": "object", "required": ["from", "to"], "properties": {
    "from": {"type": "string", "format": "date-time", "description": "the window's start (naive: the job's zone)"},
    "to": {"type": "string", "format": "date-time", "description": "the window's end, not in the future"},
    "max": {"type": "integer", "minimum": 1, "maximum": 10000, "description": "refuse more occurrences (100)"}}}


def openapi_schema() -> dict[str, Any]:
    """The schema. Actions need ``X-CSRF-Token`` (from a page) or ``Authorization: Bearer``."""
    return {
        "openapi": "3.0.3",
        "info": {"title": "mjsched dashboard API", "version": __version__,
                 "description": "Every page of the dashboard as JSON, and its actions. Times are ISO-8601 UTC."},
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
        "paths": {
            "/api/overview": _get("runs by status (last hour, last day), supervisors, in-flight runs, next due "
                                  "jobs, recent failures, totals", []),
            "/api/jobs": _get("jobs by name, filtered, keyset-paged", [
                _q("q", {"type": "string", "maxLength": 200}, "substring of name or description"),
                _q("status", {"type": "string", "enum": list(values(JobStatus))}, "job status"),
                _q("type", {"type": "string", "maxLength": 100}, "job type"),
                _q("mode", {"type": "string", "enum": list(values(ConcurrencyMode))}, "concurrency mode"),
                _q("failing", {"type": "string", "enum": ["0", "1", "true", "false"]}, "newest run failed"),
                _q("after", {"type": "string", "maxLength": 200}, "keyset: names after this"), LIMIT]),
            "/api/jobs/{name}": {"get": {"summary": "one job: configuration, statistics, upcoming occurrences, "
                                                    "run history", "parameters": [NAME, BEFORE, LIMIT],
                                         "responses": _ok("the job")}},
            "/api/jobs/{name}/run": _post("run the job once now (202: started in the background)", status="202"),
            "/api/jobs/{name}/pause": _post("pause the job"),
            "/api/jobs/{name}/resume": _post("resume the job"),
            "/api/jobs/{name}/update": _post("change the job's schedule or configuration (validated like "
                                             "`jobs update`)", body=EDIT),
            "/api/jobs/{name}/backfill": _post("run the job's occurrences of a past window (202: pending; like "
                                               "`jobs backfill`)", body=BACKFILL, status="202"),
            "/api/runs": _get("runs newest first, filtered, keyset-paged", [
                _q("job", {"type": "string", "maxLength": 200}, "job name"),
                _q("status", {"type": "string", "enum": list(values(RunStatus))}, "run status"),
                _q("supervisor", {"type": "string", "maxLength": 255}, "executed_by_instance"),
                _q("since", {"type": "string", "format": "date-time"}, "started at or after"),
                _q("until", {"type": "string", "format": "date-time"}, "started before"), BEFORE, LIMIT]),
            "/api/runs/{run_id}/cancel": {"post": {
                "summary": "ask the run's supervisor to cancel a live run (202; it stops at its next lease renewal)",
                "parameters": [RUN_ID], "responses": {**_ok("cancel requested", "202"), "409": ERROR}}},
            "/api/runs/{run_id}/retry": {"post": {
                "summary": "run the run's occurrence again: same scheduled_at, next attempt (202: pending; like "
                           "`runs retry`)", "parameters": [RUN_ID], "responses": {**_ok("retry pending", "202"),
                                                                                 "409": ERROR}}},
            "/api/runs/{run_id}": {"get": {"summary": "one run", "parameters": [RUN_ID],
                "responses": _ok("the run")}},
            "/api/audit": _get("the audit log, newest first", [BEFORE, LIMIT]),
        },
    }
