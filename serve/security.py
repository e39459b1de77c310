"""What guards every route, the page and the API's own documentation: HTTP Basic authentication (--api-auth) and
the body-size limit; both are ASGI middleware, so nothing reaches a route without them."""

from __future__ import annotations

import base64
import binascii
import json
import secrets

from sdx.errors import SdxError


def parse_auth(text: str) -> tuple[tuple[str, str], ...]:
    """--api-auth user:pass[,user:pass] -> ((user, pass), ...); an SdxError for anything else."""
    pairs = []
    for part in text.split(","):
        user, sep, password = part.partition(":")
        if not sep or not user or not password:
            raise SdxError(f"--api-auth {text!r}: give user:password pairs separated by commas")
        pairs.append((user, password))
    return tuple(pairs)


async def _answer(send, status: int, detail: str, headers: tuple = ()) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class BasicAuth:
    """Every HTTP request must carry one of `users`' name and password (compared in constant time, every pair
    every time); else 401 with WWW-Authenticate. The user's name is put in the scope as `sdx.user`."""

    def __init__(self, app, users: tuple[tuple[str, str], ...]):
        self.app, self.users = app, [(u.encode(), p.encode()) for u, p in users]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        user = self._user(dict(scope["headers"]).get(b"authorization", b""))
        if user is None:
            return await _answer(send, 401, "Incorrect username or password",
                                 ((b"www-authenticate", b'Basic realm="sdx"'),))
        scope["sdx.user"] = user
        return await self.app(scope, receive, send)

    def _user(self, header: bytes) -> str | None:
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"basic":
            return None
        try:
            user, _, password = base64.b64decode(token, validate=True).partition(b":")
        except (binascii.Error, ValueError):
            return None
        found = None
        for name, secret in self.users:  # no early exit: the time taken says nothing of which part was wrong
            if secrets.compare_digest(user, name) & secrets.compare_digest(password, secret):
                found = name.decode()
        return found


class BodyLimit:
    """A request body over `limit` bytes is answered 413, whether its Content-Length says so or it streams: the
    body is read here first (the routes read it whole anyway) and handed on only when it fits."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await _answer(send, 413, self._detail())
        chunks, seen, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return None
            chunks.append(message.get("body", b""))
            seen += len(chunks[-1])
            if seen > self.limit:
                return await _answer(send, 413, self._detail())
            more = message.get("more_body", False)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: a disconnect, when it comes
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        return await self.app(scope, replay, send)

    def _detail(self) -> str:
        return f"the request body is more than this server's --max-body-mb {self.limit / 2**20:g}"
