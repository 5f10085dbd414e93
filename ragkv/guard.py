"""What every HTTP front of ragkv puts in front of its routes (pure ASGI, so it sees the body as
it arrives and the route that matched):

- the body cap holds however the body is sent. A Content-Length over the cap is refused before
  anything is read; a chunked body (no Content-Length) is counted as it arrives and refused the
  moment it passes the cap, so nobody can make the server read or tokenise more than that;
- requests are counted by route template (`/v1/chat/completions`), never by the raw path: a
  client sending random paths would otherwise add a metrics series per path, without bound.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

from starlette.exceptions import HTTPException

UNMATCHED = "unmatched"  # the metrics label of requests no route matched (404s)


class BodyTooLarge(HTTPException):
    """Raised from `receive` once the body passes the cap. An HTTPException, so a route's body
    parser lets it through (it turns other errors into a 400); `install_errors` answers it."""

    def __init__(self, max_body_bytes: int):
        super().__init__(413, too_large_message(max_body_bytes))


def too_large_message(max_body_bytes: int) -> str:
    return f"request body over {max_body_bytes} bytes"


class RequestGuard:
    """ASGI middleware: `max_body_bytes` per request body; `count(route, status)` per response."""

    def __init__(self, app, max_body_bytes: int, count: Callable[[str, int], None] | None = None):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.count = count

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = {"code": 0}

        async def counted_send(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            if self._declared_too_large(scope):
                await self._refuse(counted_send)
                return
            try:
                await self.app(scope, self._capped(receive), counted_send)
            except BodyTooLarge:
                if not status["code"]:
                    await self._refuse(counted_send)
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

    async def _refuse(self, send) -> None:
        body = json.dumps(
            {"error": {"message": too_large_message(self.max_body_bytes), "type": "request_too_large"}}
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
