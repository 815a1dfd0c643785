"""Starting a kserve ModelServer our way: a chosen bind host, and the servers' edge.

kserve 0.21 hard-codes host="0.0.0.0" in RESTServer (docs/DEPENDENCIES.md); locally and in tests we bind 127.0.0.1 by
forcing uvicorn.Config's host. In front of kserve sits `RequestGuardMiddleware`: model control off unless
asked for, body size / time limits, and the whole request validated (serving/schema.py) before kserve decodes
it or a model looks anything up. Behind it, a model's `BadRequest` (4xx) or `UpstreamError` (502/503/504) is
answered with its own status and one log line without a traceback (kserve logs a traceback per 400, and
`OneLineClientErrors` trims its other 4xx/503 logs to one line), and `ProbeDataPlane` makes the readiness
probes tell the truth.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any

import uvicorn
from kserve.errors import InvalidInput, ModelNotFound, ModelNotReady, ServerNotReady
from kserve.protocol.dataplane import DataPlane
from starlette.requests import Request
from starlette.responses import JSONResponse

from serving import metrics
from serving.schema import BadRequest, ServeConfig, UpstreamError, cut, shown, validate_body

log = logging.getLogger("serving.edge")

V1_PREDICT = re.compile(r"/v1/models/[^/]+:predict")
V2_INFER = re.compile(r"/v2/models/[^/]+(/versions/[^/]+)?/infer")
MODEL_CONTROL = "/v2/repository/"  # kserve's load / unload endpoints

_original_config_init = uvicorn.Config.__init__


def force_bind_host(host: str) -> None:
    """Make every uvicorn.Config created from now on bind `host` (kserve passes 0.0.0.0)."""

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["host"] = host
        _original_config_init(self, *args, **kwargs)

    uvicorn.Config.__init__ = init  # type: ignore[method-assign]


def log_rejection(method: str, path: str, status: int, message: str) -> None:
    """The one line a rejected request leaves in the log: no traceback, client echoes cut short."""
    log.warning("%s %s -> %d %s", method, cut(path, 120), status, cut(message, 300))


class OneLineClientErrors(logging.Filter):
    """kserve's own error handlers log "Exception:" with a full traceback for every unknown model (404), model
    or server not ready (503) and bad input (400): anyone could fill the log 3 KB a request. Keep one line."""

    QUIET = (InvalidInput, ModelNotFound, ModelNotReady, ServerNotReady, NotImplementedError)

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, self.QUIET):
            record.msg, record.args, record.exc_info = f"{type(exc).__name__}: {cut(str(exc), 300)}", (), None
        return True


async def _send_error(send: Any, status: int, message: str) -> None:
    metrics.observe_rejected(status)
    body = json.dumps({"error": message}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class RequestGuardMiddleware:
    """Pure ASGI middleware at the edge of a server.

    - /v2/repository/... (load, unload): 403 unless `model_control` (anyone who reached the port could
      unload the model).
    - Request bodies: 413 over `max_bytes` (declared or streamed); 408 when the whole body has not arrived
      within cfg.body_timeout_s (half-sent or slow bodies).
    - Predict (v1) and infer (v2) bodies: 415 unless JSON (or no content type), then `validate_body`: every
      bad input gets its 4xx naming the field here, before kserve decodes it (raw 422s, orjson errors) and
      before the transformer's feature lookup.
    Each rejection is one log line (`log_rejection`).
    """

    def __init__(self, app: Any, cfg: ServeConfig, max_bytes: int, model_control: bool = False):
        self.app = app
        self.cfg = cfg
        self.max_bytes = max_bytes
        self.model_control = model_control

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method, path = scope.get("method", ""), scope.get("path", "")

        async def reject(status: int, message: str) -> None:
            log_rejection(method, path, status, message)
            await _send_error(send, status, message)

        if path.startswith(MODEL_CONTROL) and not self.model_control:
            await reject(
                403, "model control is off (start the server with --enable_model_control to allow it)"
            )
            return
        if method not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await reject(
                413, f"body: payload of {declared.decode()} bytes exceeds the limit of {self.max_bytes} bytes"
            )
            return
        # read and count the stream (within the time limit), then replay it to the app
        chunks, total, more = [], 0, True
        try:
            async with asyncio.timeout(self.cfg.body_timeout_s):
                while more:
                    msg = await receive()
                    if msg["type"] == "http.disconnect":
                        return
                    chunk = msg.get("body", b"")
                    total += len(chunk)
                    if total > self.max_bytes:
                        await reject(
                            413, f"body: payload of more than {self.max_bytes} bytes exceeds the limit"
                        )
                        return
                    chunks.append(chunk)
                    more = msg.get("more_body", False)
        except TimeoutError:
            await reject(408, f"body: not received within {self.cfg.body_timeout_s:g} s ({total} bytes came)")
            return
        body, sent = b"".join(chunks), False
        v2 = V2_INFER.fullmatch(path) is not None
        if v2 or V1_PREDICT.fullmatch(path):
            ctype = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if ctype not in (b"", b"application/json"):
                await reject(
                    415, f"content-type: must be application/json, got {shown(ctype.decode('latin-1'))}"
                )
                return
            try:
                validate_body(body, v2, self.cfg)
            except BadRequest as e:
                await reject(e.status, str(e))
                return

        async def replay() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _error_response(request: Request, exc: Exception) -> JSONResponse:
    """A model's BadRequest or UpstreamError: its status, {"error": message}, one log line."""
    status = getattr(exc, "status", 500)
    log_rejection(request.method, request.url.path, status, str(exc))
    return JSONResponse({"error": str(exc)}, status_code=status)


class ProbeDataPlane(DataPlane):
    """kserve's data plane with readiness probes that reflect what is loaded and reachable.

    kserve's /v2/health/ready answers ready whatever the models' state (still ready after an unload). Here the
    server is ready when it has models and every one is ready; a model with an `upstream_ready()` coroutine
    (the transformer: its predictor) is ready only if that says so too, on /v2/health/ready, /v1/models/<name>
    and /v2/models/<name>/ready. The infer path (kserve passes disable_predictor_health_check=True there)
    stays as in kserve and does not call upstream.
    """

    async def _probe(self, model: Any) -> bool:
        if not await model.healthy():
            return False
        upstream = getattr(model, "upstream_ready", None)
        return upstream is None or await upstream()

    async def ready(self) -> bool:
        models = list(self.model_registry.get_models().values())
        return bool(models) and all([await self._probe(m) for m in models])

    async def model_ready(self, model_name: str, disable_predictor_health_check: bool = False) -> bool:
        model = self.model_registry.get_model(model_name)
        if model is None:
            raise ModelNotFound(model_name)
        if disable_predictor_health_check:
            return await model.healthy()
        return await self._probe(model)


def start_model_server(
    models: list[Any],
    http_port: int,
    host: str = "127.0.0.1",
    cfg: ServeConfig | None = None,
    max_body_bytes: int | None = None,
    model_control: bool = False,
) -> None:
    """Blocking: serve `models` (already loaded) over REST only, bound to `host`, behind the edge guard.

    `max_body_bytes` defaults to cfg.max_body_bytes (the predictor passes cfg.forwarded_body_bytes());
    `model_control` turns kserve's load / unload endpoints on."""
    import kserve
    import kserve.model_server

    cfg = cfg or ServeConfig()
    force_bind_host(host)
    app = kserve.model_server.app
    app.add_middleware(
        RequestGuardMiddleware,
        cfg=cfg,
        max_bytes=max_body_bytes or cfg.max_body_bytes,
        model_control=model_control,
    )
    app.add_exception_handler(BadRequest, _error_response)
    app.add_exception_handler(UpstreamError, _error_response)
    logging.getLogger("kserve").addFilter(OneLineClientErrors())  # the logger kserve.errors' handlers use
    server = kserve.ModelServer(http_port=http_port, enable_grpc=False, workers=1)
    server.dataplane = ProbeDataPlane(model_registry=server.registered_models)
    server.start(models)
