"""Starting a kserve ModelServer our way: a chosen bind host and a request-body size limit.

kserve 0.21 hard-codes host="0.0.0.0" in RESTServer (STACK.md §3); locally and in tests we bind 127.0.0.1 by
forcing uvicorn.Config's host. Oversized bodies are refused with 413 before kserve parses them.
"""

from __future__ import annotations

import json
from typing import Any

import uvicorn

from serving import metrics

_original_config_init = uvicorn.Config.__init__


def force_bind_host(host: str) -> None:
    """Make every uvicorn.Config created from now on bind `host` (kserve passes 0.0.0.0)."""

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["host"] = host
        _original_config_init(self, *args, **kwargs)

    uvicorn.Config.__init__ = init  # type: ignore[method-assign]


async def _send_error(send: Any, status: int, message: str) -> None:
    metrics.observe_rejected(status)
    body = json.dumps({"error": message}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class RequestGuardMiddleware:
    """Pure ASGI middleware: 413 when a body exceeds `max_bytes` (declared or streamed); 400 for malformed JSON."""

    def __init__(self, app: Any, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def _reject(self, send: Any, size: str) -> None:
        await _send_error(
            send, 413, f"body: payload of {size} bytes exceeds the limit of {self.max_bytes} bytes"
        )

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._reject(send, declared.decode())
            return
        # no (or a small) declared length: read and count the stream, then replay it to the app
        chunks, total, more = [], 0, True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunk = msg.get("body", b"")
            total += len(chunk)
            if total > self.max_bytes:
                await self._reject(send, f"more than {self.max_bytes}")
                return
            chunks.append(chunk)
            more = msg.get("more_body", False)
        body, sent = b"".join(chunks), False
        # malformed JSON: one 400 naming the body for v1 and v2 alike (kserve answers 400/422 differently)
        ctype = dict(scope.get("headers") or []).get(b"content-type", b"")
        if body and b"json" in ctype:
            try:
                json.loads(body)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                await _send_error(send, 400, f"body: malformed JSON ({e})")
                return

        async def replay() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def start_model_server(
    models: list[Any], http_port: int, host: str = "127.0.0.1", max_body_bytes: int = 256 * 1024
) -> None:
    """Blocking: serve `models` (already loaded) over REST only, bound to `host`, with the body limit."""
    import kserve
    import kserve.model_server

    force_bind_host(host)
    kserve.model_server.app.add_middleware(RequestGuardMiddleware, max_bytes=max_body_bytes)
    kserve.ModelServer(http_port=http_port, enable_grpc=False, workers=1).start(models)
