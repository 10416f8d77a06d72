"""The agent endpoint: an OpenAI-compatible HTTP server in front of the policy's engine.

One :class:`AgentServer` per EnvRunner serves the runner's engine to the agents it plays. Each
episode gets an :class:`~flashrl.agents.session.AgentSession` and its own root,
``{url}/sessions/{key}/v1``, which the agent's ``openai`` client takes as ``base_url``:

* ``POST /sessions/{key}/v1/chat/completions``: one model call (:mod:`flashrl.agents.protocol` says
  what a request may ask; :mod:`flashrl.agents.recorder` how it is recorded);
* ``POST /sessions/{key}/v1/responses``: one model call through OpenAI's Responses API, served as the
  chat request it means (:mod:`flashrl.agents.responses_api`);
* ``GET /sessions/{key}/v1/models``: the served model (``model_name``).

A request with ``stream=true`` (chat or Responses) is answered with server-sent events of the recorded
reply (:mod:`flashrl.agents.streaming`).

Security (docs/agents.md, "Security model"): the server binds to 127.0.0.1 unless told otherwise
(``host``). A call on a session must carry ``Authorization: Bearer <key>``, that session's own key (a
fresh ``secrets.token_urlsafe`` per episode, compared in constant time), else HTTP 401, which also
closes the connection; the key is refused once the episode's session is closed (HTTP 404
``session_closed``). The server's own token (``api_key``) opens no session: with it, an unknown
session is HTTP 404; without a session's key or the server's token, every path is HTTP 401, so a caller
without a key learns nothing of the sessions. Refusals carry ``x-should-retry: false``, so the
``openai`` client does not retry them.

Before a request is read: at most ``max_connections`` connections, headers within ``max_header_bytes``
and ``request_timeout_s`` (:mod:`flashrl.agents.connections`). A body is read up to
``max_request_bytes`` (HTTP 413 past it, before any parsing) within ``request_timeout_s``; it is then
parsed, checked and rendered in the server's one rendering thread, off the event loop, so a large or
deeply nested request does not stall the other episodes; every refusal is an OpenAI-style error
counted in the session's ``errors``, and a session's refusals are capped (``AgentLimits.max_refused``).

It runs in the current asyncio loop (the runner's), as a uvicorn server task on a socket bound here
(port 0: any free port), without taking over the process's signal handlers.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
import socket
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from flashrl.agents.connections import ConnectionLimits, ConnectionStats, guarded_protocol
from flashrl.agents.protocol import SAMPLING_OVERRIDES, RequestRefused, models_list, request_class
from flashrl.agents.session import AgentLimits, AgentSession, closed_refusal
from flashrl.agents.streaming import server_sent_events
from flashrl.conversation import chat_stop_token_ids
from flashrl.engines.types import Engine, SamplingConfig

__all__ = ["AgentLimits", "AgentServer", "AgentSession", "ConnectionLimits"]

logger = logging.getLogger("flashrl.agents")

_NO_RETRY = {"x-should-retry": "false"}
MAX_REQUEST_BYTES = 8 * 1024 * 1024
"""Default largest request body (a long conversation with tool schemas is well under 1 MiB a 32k context)."""


class AgentServer:
    """Serves ``engine`` to agents over OpenAI's chat-completions API, one session per episode.

    Args:
        engine: The runner's inference engine.
        sampling: The run's ``SamplingConfig`` fields except seed and stop tokens (``temperature``,
            ``top_p``, ``top_k``, ``max_tokens``): every call samples with them.
        max_episode_tokens: Context budget of a call's prompt and reply (and of each segment).
        model_name: The model name ``GET .../models`` reports and requests must name.
        host: Address to bind; 127.0.0.1 (this machine only) by default.
        port: Port to bind; 0 picks a free one (read :attr:`url` after :meth:`start`).
        api_key: The token requests must carry; None draws a fresh one.
        max_observation_tokens: Longest non-assistant message after a recorded reply, cut with a
            marker (None: no limit).
        connections: The cap on connections and on header size and time (`ConnectionLimits`).
        max_request_bytes: Largest request body; a larger one gets HTTP 413 before it is parsed.
        sampling_overrides: What a request's setting that would change the distribution sampled from
            gets: ``"refuse"`` (HTTP 400) or ``"ignore"`` (served with the run's sampling, counted);
            :mod:`flashrl.agents.protocol` lists them.
    """

    def __init__(
        self, engine: Engine, *, sampling: Mapping[str, Any], max_episode_tokens: int, model_name: str,
        host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
        max_observation_tokens: int | None = None, connections: ConnectionLimits | None = None,
        max_request_bytes: int = MAX_REQUEST_BYTES, sampling_overrides: str = "refuse",
    ) -> None:
        if max_episode_tokens < 2:
            raise ValueError(f"max_episode_tokens must be >= 2 (a prompt and a reply token); got {max_episode_tokens}.")
        if api_key is not None and not api_key:
            raise ValueError("api_key must be None (a fresh token) or a non-empty string.")
        self.engine = engine
        unknown = sorted(set(sampling) - {"temperature", "top_p", "top_k", "max_tokens"})
        if unknown:
            raise ValueError(
                f"sampling: expected the run's SamplingConfig fields temperature, top_p, top_k, max_tokens; got "
                f"also {unknown} (seed and stop_token_ids are the endpoint's own)."
            )
        self.sampling = SamplingConfig(**sampling)
        """The run's sampling; each call gets its own max_tokens, seed and stop tokens."""
        self.sampling.validate()
        self.max_episode_tokens = int(max_episode_tokens)
        self.model_name = model_name
        self.host = host
        self.port = int(port)
        self.api_key = api_key if api_key is not None else secrets.token_urlsafe(32)
        self.max_observation_tokens = max_observation_tokens
        self._stop_ids = chat_stop_token_ids(engine.tokenizer)
        self._sessions: dict[str, AgentSession] = {}
        self._closed: weakref.WeakValueDictionary[str, AgentSession] = weakref.WeakValueDictionary()
        self._server: Any = None
        self._task: asyncio.Task[None] | None = None
        self._url: str | None = None
        self._created = int(time.time())
        self.connections = connections if connections is not None else ConnectionLimits()
        if not isinstance(max_request_bytes, int) or max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be an int >= 1024; got {max_request_bytes!r}.")
        self.max_request_bytes = max_request_bytes
        self.connection_stats = ConnectionStats()
        """What the connections did: opened, evicted, refused, header timeouts, bad HTTP."""
        self._render_pool: ThreadPoolExecutor | None = None
        self._internal_errors = 0
        if sampling_overrides not in SAMPLING_OVERRIDES:
            raise ValueError(f"sampling_overrides must be one of {SAMPLING_OVERRIDES}; got {sampling_overrides!r}.")
        self.sampling_overrides = sampling_overrides

    @property
    def url(self) -> str:
        """The root URL, ``http://HOST:PORT`` (after :meth:`start`)."""
        if self._url is None:
            raise RuntimeError("AgentServer.url before start(); await server.start() first.")
        return self._url

    async def start(self) -> str:
        """Bind and serve in the running event loop; return :attr:`url`. Idempotent."""
        if self._task is not None and not self._task.done():
            return self.url
        request_class()  # imports vLLM's protocol now, not in the first agent's call
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as err:
            sock.close()
            raise OSError(f"AgentServer cannot bind {self.host}:{self.port}: {err}; pass port=0 for a free port.") from err
        sock.listen(128)
        sock.setblocking(False)
        # one thread renders for all sessions: requests are parsed and tokenised off the loop, in order
        # (a fast tokenizer is not meant to be driven from several threads at once)
        self._render_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agent-render")
        limits = self.connections
        config = uvicorn.Config(
            self._app(), log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=5,
            http=guarded_protocol(limits, self.connection_stats), h11_max_incomplete_event_size=limits.max_header_bytes,
            timeout_keep_alive=limits.keep_alive_s,
        )
        self._server = _quiet_server(config)
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise RuntimeError("the agent endpoint stopped while starting")
            await asyncio.sleep(0.01)
        host, port = sock.getsockname()[:2]
        self._url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        return self._url

    async def stop(self) -> None:
        """Stop serving (open connections get up to 5 s). Idempotent."""
        if self._task is None:
            return
        self._server.should_exit = True
        task, self._task = self._task, None
        try:
            await task
        finally:
            if self._render_pool is not None:
                self._render_pool.shutdown(wait=False, cancel_futures=True)
                self._render_pool = None

    def open_session(self, *, prompt_id: str, seed: int, limits: AgentLimits) -> AgentSession:
        """A new episode's session; its ``base_url`` and ``api_key`` (its own key) go to the agent."""
        key = secrets.token_urlsafe(16)
        session = AgentSession(
            key=key, base_url=f"{self.url}/sessions/{key}/v1", api_key=secrets.token_urlsafe(32), prompt_id=str(prompt_id),
            seed=seed, limits=limits, engine=self.engine, sampling=self.sampling, model_name=self.model_name,
            max_episode_tokens=self.max_episode_tokens, max_observation_tokens=self.max_observation_tokens,
            stop_token_ids=self._stop_ids, on_close=self._forget, executor=self._render_pool,
            sampling_overrides=self.sampling_overrides,
        )
        self._sessions[key] = session
        return session

    def _forget(self, session: AgentSession) -> None:
        """A closed session leaves the live ones; it is still counted while someone holds it."""
        if self._sessions.pop(session.key, None) is not None:
            self._closed[session.key] = session

    # ----------------------------------------------------------------------------- HTTP
    def _app(self) -> FastAPI:
        app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(RequestRefused)
        async def refused(_: Request, err: RequestRefused) -> JSONResponse:
            # a caller without a key keeps no connection: each try costs it a new one (see connections.py). A body
            # refused unread (413) is drained, not kept, within request_timeout_s (the connection's header timer), so
            # that the client reads the 413 rather than a reset
            headers = {**_NO_RETRY, "connection": "close"} if err.status == 401 else _NO_RETRY
            return JSONResponse(err.body(), status_code=err.status, headers=headers)

        @app.post("/sessions/{key}/v1/chat/completions")
        async def chat_completions(key: str, request: Request) -> Response:
            reply = await self._answer(key, request, AgentSession.chat)
            if isinstance(reply, list):  # stream=true: the recorded reply's chunks, as server-sent events
                return _event_stream(server_sent_events(reply))
            return JSONResponse(reply)

        @app.post("/sessions/{key}/v1/responses")
        async def responses(key: str, request: Request) -> Response:
            reply = await self._answer(key, request, AgentSession.respond)
            if isinstance(reply, list):  # stream=true: the recorded response's stream events
                return _event_stream(server_sent_events(reply, named=True))
            return JSONResponse(reply)

        @app.get("/sessions/{key}/v1/models")
        async def models(key: str, request: Request) -> JSONResponse:
            self._session(key, request)
            return JSONResponse(models_list(self.model_name, self._created))

        return app

    async def _answer(self, key: str, request: Request, answer: Callable[[AgentSession, bytes], Awaitable[Any]]) -> Any:
        """``answer(session, body)`` for a model call on session ``key``: refusals counted, a failure of the
        endpoint itself an HTTP 500."""
        session = self._session(key, request)
        try:
            session.check_refusals()
            raw = await self._read_body(request)
        except RequestRefused as err:
            if err.code == "refusal_limit":
                raise  # counted by check_refusals
            session.errors[err.code] += 1
            raise
        try:
            return await answer(session, raw)
        except RequestRefused:
            raise
        except Exception as err:  # noqa: BLE001 - a bug of the endpoint: the agent gets a 500, the log one line
            raise self._internal_error(session, err) from None

    async def _read_body(self, request: Request) -> bytes:
        """The request's body, refused (HTTP 413) past ``max_request_bytes`` before it is all read, and
        (HTTP 408) when it does not arrive within ``request_timeout_s``."""
        limit = self.max_request_bytes
        too_large = RequestRefused(413, "request_too_large", f"the request body is over this endpoint's "
                                   f"{limit} bytes (max_request_bytes); shorten the messages.")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.connections.request_timeout_s):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise too_large
                    chunks.append(chunk)
        except TimeoutError:
            raise RequestRefused(408, "request_timeout", f"the request body did not arrive within "
                                 f"{self.connections.request_timeout_s} s.") from None
        return b"".join(chunks)

    def _internal_error(self, session: AgentSession, err: Exception) -> RequestRefused:
        """A call the endpoint failed on (a bug, not the request): counted, logged once with its traceback and
        then in one line, so that no request can fill the runner's log."""
        self._internal_errors += 1
        session.errors["internal_error"] += 1
        if self._internal_errors == 1:
            logger.error("The agent endpoint failed a call of session %s.", session.key, exc_info=err)
        else:
            logger.error("The agent endpoint failed a call of session %s (failure %d): %s: %.200s", session.key,
                         self._internal_errors, type(err).__name__, err)
        return RequestRefused(500, "internal_error", f"the endpoint failed: {type(err).__name__}", type="server_error")

    def _session(self, key: str, request: Request) -> AgentSession:
        """The open session ``key`` of a request that carries its key; raise (and count) ``RequestRefused``."""
        session = self._sessions.get(key) or self._closed.get(key)
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip().encode() if scheme.lower() == "bearer" else b""
        if session is not None and hmac.compare_digest(given, session.api_key.encode()):
            if session.closed:
                refusal = closed_refusal()
                session.errors[refusal.code] += 1
                raise refusal
            return session
        if session is None and hmac.compare_digest(given, self.api_key.encode()):
            raise RequestRefused(404, "session_not_found", f"no agent session {key!r} on this endpoint; use the "
                                 "base_url of an open session.", type="not_found_error")
        if session is not None:
            session.errors["invalid_api_key"] += 1
        raise RequestRefused(401, "invalid_api_key", "missing or wrong API key: send the episode's key as "
                             "'Authorization: Bearer <api_key>' (the session's api_key, valid while its episode runs).")


def _event_stream(events: Iterable[bytes]) -> Response:
    """Server-sent events, all at once: the reply is sampled and recorded before its first event."""
    return Response(b"".join(events), media_type="text/event-stream", headers={"cache-control": "no-cache"})


def _quiet_server(config: Any) -> Any:
    """A ``uvicorn.Server`` that leaves the process's signal handlers alone (it is not the main program)."""

    class QuietServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return QuietServer(config)
