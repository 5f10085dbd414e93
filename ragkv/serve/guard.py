"""What every HTTP front of ragkv puts in front of its routes (pure ASGI, so it sees the body as
it arrives and the route that matched):

- the body cap holds however the body is sent. A Content-Length over the cap is refused before
  anything is read; a chunked body (no Content-Length) is counted as it arrives and refused the
  moment it passes the cap, so nobody can make the server read or tokenise more than that;
- requests are counted by route template (`/v1/chat/completions`), never by the raw path: a
  client sending random paths would otherwise add a metrics series per path, without bound;
- with `max_in_flight`, a request that finds that many already in flight gets ragkv's own 503
  with Retry-After (health and metrics probes excepted). Uvicorn's `limit_concurrency` answers a
  bare 503 with no Retry-After, so the server runs it only as a far higher backstop
  (`backstop_concurrency`), and clients always learn when to come back.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

from starlette.exceptions import HTTPException

UNMATCHED = "unmatched"  # the metrics label of requests no route matched (404s)
UNLIMITED_PATHS = frozenset({"/healthz", "/metrics"})  # probes: answered however busy the server is


class BodyTooLarge(HTTPException):
    """Raised from `receive` once the body passes the cap. An HTTPException, so a route's body
    parser lets it through (it turns other errors into a 400); `install_errors` answers it."""

    def __init__(self, max_body_bytes: int):
        super().__init__(413, too_large_message(max_body_bytes))


def too_large_message(max_body_bytes: int) -> str:
    return f"request body over {max_body_bytes} bytes"


def backstop_concurrency(max_in_flight: int) -> int:
    """Uvicorn's own limit (connections and tasks) for a guard allowing `max_in_flight`: well above
    it, so the guard's 503 with Retry-After is what a busy client meets."""
    return max_in_flight * 4 + 256


class RequestGuard:
    """ASGI middleware: `max_body_bytes` per request body; `count(route, status)` per response;
    at most `max_in_flight` requests at once (None: no limit), beyond that 503 with Retry-After."""

    def __init__(
        self,
        app,
        max_body_bytes: int,
        count: Callable[[str, int], None] | None = None,
        max_in_flight: int | None = None,
    ):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.count = count
        self.max_in_flight = max_in_flight
        self.in_flight = 0  # touched only on the event loop's thread

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = {"code": 0}

        async def counted_send(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        limited = self.max_in_flight is not None and scope.get("path") not in UNLIMITED_PATHS
        try:
            if limited and self.in_flight >= (self.max_in_flight or 0):
                await self._refuse(counted_send, 503, "the server is busy; retry shortly", "server_busy")
                return
            if self._declared_too_large(scope):
                await self._refuse_too_large(counted_send)
                return
            self.in_flight += limited
            try:
                await self.app(scope, self._capped(receive), counted_send)
            except BodyTooLarge:
                if not status["code"]:
                    await self._refuse_too_large(counted_send)
            finally:
                self.in_flight -= limited
        finally:
            if self.count is not None:
                route = scope.get("route")
                self.count(getattr(route, "path", UNMATCHED), status["code"] or 500)

    def _declared_too_large(self, scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                return not value.isdigit() or int(value) > self.max_body_bytes
        return False

    def _capped(self, receive) -> Callable[[], Awaitable[dict]]:
        received = 0

        async def capped_receive() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise BodyTooLarge(self.max_body_bytes)
            return message

        return capped_receive

    async def _refuse_too_large(self, send) -> None:
        await self._refuse(send, 413, too_large_message(self.max_body_bytes), "request_too_large")

    async def _refuse(self, send, status: int, message: str, kind: str) -> None:
        body = json.dumps({"error": {"message": message, "type": kind}}).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        if status == 503:
            headers.append((b"retry-after", b"1"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
