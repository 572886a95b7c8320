"""ASGI guard in front of the app: request ids, body size limit, Bearer keys on /v1 and /admin (constant-time compare).

Checks run before FastAPI parses anything, so an oversize or unauthenticated request never reaches a
handler. /health, /ready and /metrics stay open (the server binds 127.0.0.1 by default). Every response
carries `X-Request-Id`: the client's (printable ASCII, up to 128 characters) or a new one; handlers read
it from `scope["tandem.request_id"]`, and one log line per /v1 request carries it.
"""
from __future__ import annotations

import hmac
import logging
import re
import time
import uuid

from starlette.responses import JSONResponse

from tandem.server.schemas import error_body

log = logging.getLogger("tandem.server")
REQUEST_ID = re.compile(rb"[\x21-\x7e]{1,128}")


def request_id(header: bytes | None) -> str:
    return header.decode() if header is not None and REQUEST_ID.fullmatch(header) else uuid.uuid4().hex


def key_matches(header: bytes | None, key: str) -> bool:
    expected = b"Bearer " + key.encode()
    return header is not None and hmac.compare_digest(header, expected)


class Guard:
    def __init__(self, app, max_body_bytes: int, api_key: str | None, admin_key: str | None):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.api_key, self.admin_key = api_key, admin_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        rid = scope["tandem.request_id"] = request_id(headers.get(b"x-request-id"))
        start, status = time.perf_counter(), [0]

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message = message | {"headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
            await send(message)

        try:
            await self._guarded(scope, receive, send_with_id, headers)
        finally:
            if scope["path"].startswith("/v1"):
                log.info("%s %s %d %.3f s", scope["method"], scope["path"], status[0], time.perf_counter() - start,
                         extra={"request_id": rid, "method": scope["method"], "path": scope["path"], "status": status[0],
                                "duration_s": round(time.perf_counter() - start, 4)})

    async def _guarded(self, scope, receive, send, headers):
        denied = self._auth(scope["path"], headers.get(b"authorization"))
        if denied is not None:
            return await denied(scope, receive, send)
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            return await self._too_large()(scope, receive, send)
        messages, size = [], 0
        while True:  # read the body up to the limit, then replay it to the app
            message = await receive()
            if message["type"] != "http.request":
                return
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                return await self._too_large()(scope, receive, send)
            messages.append(message)
            if not message.get("more_body"):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()

        return await self.app(scope, replay, send)

    def _auth(self, path: str, header: bytes | None) -> JSONResponse | None:
        if path.startswith("/admin"):
            if self.admin_key is None:
                return None  # no admin routes exist: the app answers 404
            if not key_matches(header, self.admin_key):
                return _unauthorized("the admin API needs `Authorization: Bearer <admin key>`")
        elif path.startswith("/v1") and self.api_key is not None and not key_matches(header, self.api_key):
            return _unauthorized("invalid or missing API key: send `Authorization: Bearer <key>`")
        return None

    def _too_large(self) -> JSONResponse:
        return JSONResponse(error_body(f"request body exceeds {self.max_body_bytes} bytes", code="request_too_large"), 413)


def _unauthorized(message: str) -> JSONResponse:
    return JSONResponse(error_body(message, "authentication_error", code="invalid_api_key"), 401, headers={"WWW-Authenticate": "Bearer"})
