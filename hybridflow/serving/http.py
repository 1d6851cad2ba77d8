"""The HTTP side of the server: who may call, errors as OpenAI's JSON, bodies, server-sent events, and running
an aiohttp application from a thread of its own. Nothing here knows OpenAI's routes or the engine.

Who may call: a server on a non-loopback address needs a token, and then every request must carry
``Authorization: Bearer <token>``. A request is answered only when its body is JSON (``Content-Type:
application/json``; else 415): a web page can make the browser send a ``text/plain`` POST to a loopback port
without asking first, but not a JSON one. Without a token, a request that carries an ``Origin`` other than a
loopback one (a page the user opened, or one whose name was rebound to 127.0.0.1) is refused with 403; API
clients send no ``Origin``.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web
from aiohttp.typedefs import Middleware

from hybridflow.serving.openai_format import RequestError, error_body

logger = logging.getLogger(__name__)
VERSION_HEADER = "X-Weight-Version"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` (a name or an address) is this machine's loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host or "").is_loopback
    except ValueError:
        return False


def json_response(body: dict, version: int, status: int = 200) -> web.Response:
    """``body`` as JSON, with the weight version that produced it in ``X-Weight-Version``."""
    return web.json_response(body, status=status, headers={VERSION_HEADER: str(version)})


async def read_json(request: web.Request) -> dict:
    """The request's body, which must be a JSON object (400 otherwise)."""
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RequestError(f"the request body is not valid JSON: {err}") from err
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body


async def send_events(request: web.Request, events: list[dict], version: int) -> web.StreamResponse:
    """``events`` as server-sent events, then ``[DONE]``."""
    headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", VERSION_HEADER: str(version)}
    response = web.StreamResponse(headers=headers)
    await response.prepare(request)
    for event in events:
        await response.write(f"data: {json.dumps(event)}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def errors_as_json(version: Callable[[], int]) -> Middleware:
    """Every failure as OpenAI's error JSON: a ``RequestError`` with its status, aiohttp's own (404 for an
    unknown route...), and anything else as the server's 500."""

    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        """The handler's answer, or its failure as OpenAI's error JSON."""
        try:
            return await handler(request)
        except RequestError as error:
            kind = "authentication_error" if error.status == 401 else "invalid_request_error"
            return json_response(
                error_body(str(error), kind, error.param, error.code), version(), error.status
            )
        except web.HTTPException as error:
            if error.status < 400:
                raise
            message = f"{request.method} {request.path}: {error.reason}"
            return json_response(error_body(message, "invalid_request_error"), version(), error.status)
        except ConnectionResetError:
            raise  # the client went away: nobody to answer
        except Exception as error:  # noqa: BLE001 - an engine failure is the server's error, in JSON
            logger.exception("request %s failed", request.path)
            return json_response(
                error_body(f"{type(error).__name__}: {error}", "server_error"), version(), 500
            )

    return errors


def guard(token: str | None) -> Middleware:
    """Who may call (see the module's docstring): the token, then a web page's origin, then JSON bodies."""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        """The handler's answer for a caller that may call; a ``RequestError`` (401, 403, 415) otherwise."""
        if token:
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                raise RequestError(
                    "a valid 'Authorization: Bearer <token>' header is required",
                    status=401,
                    code="invalid_api_key",
                )
        origin = request.headers.get("Origin")
        if not token and origin is not None and not is_loopback(urlsplit(origin).hostname):
            raise RequestError(
                f"requests from the web origin {origin!r} are refused: this server has no token, so only "
                "clients on this machine may call it (serve with --token to allow other origins)",
                status=403,
                code="origin_not_allowed",
            )
        if request.method == "POST" and request.content_type != "application/json":
            raise RequestError(
                f"the body must be JSON (Content-Type: application/json), got {request.content_type!r}",
                status=415,
                code="unsupported_media_type",
            )
        return await handler(request)

    return check


class LoopThread:
    """An asyncio loop in a daemon thread that runs ``start()`` and then serves until ``stop()`` (both
    coroutines of the served object), so the caller's thread stays free."""

    def __init__(
        self, start: Callable[[], Coroutine[Any, Any, object]], stop: Callable[[], Coroutine[Any, Any, None]]
    ) -> None:
        self._start, self._stop = start, stop
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def run(self) -> None:
        """Start serving in the thread; returns once ``start()`` finished (re-raising what it raised)."""
        started, failure = threading.Event(), []

        def serve() -> None:
            """The thread: start, tell the caller, then serve until stopped."""
            self._loop = asyncio.new_event_loop()
            try:
                self._loop.run_until_complete(self._start())
            except BaseException as error:  # noqa: BLE001 - reported to the starting thread
                failure.append(error)
                started.set()
                return
            started.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=serve, name="hybridflow-server", daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            raise failure[0]

    def join(self) -> None:
        """Run ``stop()`` on the loop, then end the loop and its thread."""
        if self._loop is None or self._thread is None:
            return
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()
        self._loop = self._thread = None
