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
from collections import Counter
from http import HTTPStatus
from typing import Any, ClassVar

import h11
import uvicorn
from kserve.errors import InvalidInput, ModelNotFound, ModelNotReady, ServerNotReady
from kserve.protocol.dataplane import DataPlane
from starlette.requests import Request
from starlette.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from serving import metrics
from serving.schema import (
    BadRequest,
    PrintableLogs,
    ServeConfig,
    UpstreamError,
    cut,
    printable,
    shown,
    validate_body,
)

log = logging.getLogger("serving.edge")

V1_PREDICT = re.compile(r"/v1/models/[^/]+:predict")
V2_INFER = re.compile(r"/v2/models/[^/]+(/versions/[^/]+)?/infer")
MODEL_CONTROL = "/v2/repository/"  # kserve's load / unload endpoints

_original_config_init = uvicorn.Config.__init__


def force_uvicorn_config(**settings: Any) -> None:
    """Make every uvicorn.Config created from now on use `settings` (kserve creates it: host 0.0.0.0, its own
    timeout_keep_alive, uvicorn's default HTTP implementation)."""

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.update(settings)
        _original_config_init(self, *args, **kwargs)

    uvicorn.Config.__init__ = init  # type: ignore[method-assign]


def drop_kserve_timing() -> None:
    """Make kserve's REST server leave out timing_asgi's TimingMiddleware (its `_add_middlewares` adds it to every
    app). Per request it calls getrusage twice and logs two kserve.trace lines, wall time and "cpu" time; the cpu
    time is the whole process's, decoding threads included, so it says nothing of the request. Measured with
    py-spy at 32 concurrent clients (docs/SERVING.md): half the event loop's time holding the GIL, which the
    decoding thread then waits for. Each request's latency is in our own histograms (serving/metrics.py)."""
    from kserve.protocol.rest.server import RESTServer
    from timing_asgi import TimingMiddleware

    add = getattr(RESTServer._add_middlewares, "kserve_original", RESTServer._add_middlewares)

    def add_without_timing(self: Any, app: Any) -> None:
        add(self, app)
        app.user_middleware = [m for m in app.user_middleware if m.cls is not TimingMiddleware]

    add_without_timing.kserve_original = add  # type: ignore[attr-defined]  # patching twice keeps one layer
    RESTServer._add_middlewares = add_without_timing


def log_rejection(method: str, path: str, status: int, message: str) -> None:
    """The one line a rejected request leaves in the log: no traceback, client echoes cut short and escaped."""
    log.warning("%s %s -> %d %s", method, printable(cut(path, 120)), status, printable(cut(message, 300)))


def raw_response(status: int, message: str) -> bytes:
    """A whole HTTP/1.1 error answer, {"error": message}, that closes the connection: for the server's own
    refusals before any request exists (an unfinished or oversized head)."""
    body = json.dumps({"error": message}).encode()
    reason = HTTPStatus(status).phrase
    head = f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
    return (head + "connection: close\r\n\r\n").encode() + body


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the bounds uvicorn leaves out (docs/SECURITY.md). h11 caps an unfinished request
    head at `h11_max_incomplete_event_size` bytes (set to limits.max_header_bytes; httptools, uvicorn's choice
    when installed, has no cap: a 64 MB header was accepted). Added here:

    - a connection that has sent nothing, new or between requests, is closed after `timeout_keep_alive`
      (uvicorn arms that timer only after a first response: a silent connection stayed open for ever);
    - a request head that has begun must be complete within limits.header_timeout_s, else 408 and close (one
      header byte every 10 s kept a connection open for ever);
    - a head over the cap is answered 431 naming it, not uvicorn's bare 400.
    The body's own time limit is `RequestGuardMiddleware`'s."""

    limits: ClassVar[ServeConfig] = ServeConfig()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            if self.head_timer is None:  # the first bytes of a head: the whole head within the limit
                self.head_timer = self.loop.call_later(self.limits.header_timeout_s, self.head_timeout)
        elif self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
        super().connection_lost(exc)

    def head_timeout(self) -> None:
        self.head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.refuse(408, f"headers: not received within {self.limits.header_timeout_s:g} s")

    def send_400_response(self, msg: str) -> None:
        """What uvicorn sends for a head h11 refuses: 431 when it is over the cap, else 400."""
        if len(self.conn.trailing_data[0]) > self.limits.max_header_bytes:
            self.refuse(431, f"headers: the request head exceeds {self.limits.max_header_bytes} bytes")
        else:
            self.refuse(400, f"request: not valid HTTP/1.1 ({msg})")

    def refuse(self, status: int, message: str) -> None:
        log_rejection("-", "-", status, message)
        metrics.observe_rejected(status)
        self.transport.write(raw_response(status, message))
        self.transport.close()


def escape_all_logs() -> None:
    """`PrintableLogs` on every handler configured so far (kserve's, uvicorn's, the root's)."""
    loggers = [logging.getLogger(), *(logging.getLogger(n) for n in list(logging.root.manager.loggerDict))]
    for handler in {h for lg in loggers for h in lg.handlers}:
        if not any(isinstance(f, PrintableLogs) for f in handler.filters):
            handler.addFilter(PrintableLogs())


# Headers a request may carry once: a second Content-Type was read by the guard while FastAPI read the other.
SINGLE_HEADERS = (
    b"content-type",
    b"content-length",
    b"host",
    b"authorization",
    b"x-request-id",
    b"x-b3-traceid",
)
# What kserve's transformer forwards to its predictor (kserve.model._FORWARDABLE_HEADERS): httpx refuses to send
# a non-ASCII value, which made a client's header a 502.
FORWARDED_HEADERS = (b"authorization", b"x-request-id", b"x-b3-traceid")


def check_headers(headers: list[tuple[bytes, bytes]], cfg: ServeConfig) -> None:
    """Raises BadRequest (431 or 400, naming the header) for too many header fields or bytes, a header that may
    appear once sent twice, or a forwarded header that is not printable ASCII."""
    if len(headers) > cfg.max_headers:
        raise BadRequest(f"headers: {len(headers)} header fields (the limit is {cfg.max_headers})", 431)
    size = sum(len(name) + len(value) + 4 for name, value in headers)  # as sent: "name: value\r\n"
    if size > cfg.max_header_bytes:  # a head that arrived whole (h11 caps one still arriving)
        raise BadRequest(f"headers: the request head exceeds {cfg.max_header_bytes} bytes ({size})", 431)
    names = Counter(name for name, _ in headers)
    for name in SINGLE_HEADERS:
        if names[name] > 1:
            raise BadRequest(f"{name.decode()}: sent {names[name]} times (send it once)")
    for name, value in headers:
        if name in FORWARDED_HEADERS and not all(0x20 <= b < 0x7F for b in value):
            raise BadRequest(f"{name.decode()}: must be printable ASCII (it is forwarded to the predictor)")


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

        raw_headers = list(scope.get("headers") or [])
        try:
            check_headers(raw_headers, self.cfg)
        except BadRequest as e:
            await reject(e.status, str(e))
            return
        if path.startswith(MODEL_CONTROL) and not self.model_control:
            await reject(
                403, "model control is off (start the server with --enable_model_control to allow it)"
            )
            return
        if method not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        headers = dict(raw_headers)  # each header this reads appears once (`check_headers`)
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
    protocol = type("BoundedH11Protocol", (BoundedH11Protocol,), {"limits": cfg})
    force_uvicorn_config(
        host=host,
        http=protocol,
        h11_max_incomplete_event_size=cfg.max_header_bytes,
        timeout_keep_alive=cfg.idle_timeout_s,
    )
    drop_kserve_timing()
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
    # enable_latency_logging off: kserve's "kserve.trace" line per request (requestId N.A. and the ms of each
    # phase) repeats what our histograms hold (serving/metrics.py), and at 32 clients its logging cost the event
    # loop 4% of its time, under the GIL the decoding thread needs too (docs/SERVING.md)
    server = kserve.ModelServer(
        http_port=http_port, enable_grpc=False, workers=1, enable_latency_logging=False
    )
    server.dataplane = ProbeDataPlane(model_registry=server.registered_models)
    escape_all_logs()  # after kserve configured its loggers
    server.start(models)
