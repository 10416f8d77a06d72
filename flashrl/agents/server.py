"""The agent endpoint: an OpenAI-compatible HTTP server in front of the policy's engine.

One :class:`AgentServer` per EnvRunner serves the runner's engine to the agents it plays. Each
episode gets an :class:`~flashrl.agents.session.AgentSession` and its own root,
``{url}/sessions/{key}/v1``, which the agent's ``openai`` client takes as ``base_url``:

* ``POST /sessions/{key}/v1/chat/completions``: one model call (:mod:`flashrl.agents.protocol` says
  what a request may ask; :mod:`flashrl.agents.recorder` how it is recorded);
* ``GET /sessions/{key}/v1/models``: the served model (``model_name``).

Security: the server binds to 127.0.0.1 unless told otherwise (``host``); every request must carry
``Authorization: Bearer <api_key>``, the per-run token (a fresh ``secrets.token_urlsafe`` unless
given), compared in constant time, else HTTP 401 (checked before the session, so an unauthenticated
caller learns nothing of the keys). A call on an unknown or closed session gets HTTP 404. Refusals
carry ``x-should-retry: false``, so the ``openai`` client does not retry them.

It runs in the current asyncio loop (the runner's), as a uvicorn server task on a socket bound here
(port 0: any free port), without taking over the process's signal handlers.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import secrets
import socket
import time
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from flashrl.agents.protocol import RequestRefused, models_list, request_class
from flashrl.agents.session import AgentLimits, AgentSession, closed_refusal
from flashrl.conversation import chat_stop_token_ids
from flashrl.engines.types import Engine, SamplingConfig

__all__ = ["AgentLimits", "AgentServer", "AgentSession"]

_NO_RETRY = {"x-should-retry": "false"}


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
    """

    def __init__(
        self, engine: Engine, *, sampling: Mapping[str, Any], max_episode_tokens: int, model_name: str,
        host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
        max_observation_tokens: int | None = None,
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
        config = uvicorn.Config(self._app(), log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=5)
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
        await task

    def open_session(self, *, prompt_id: str, seed: int, limits: AgentLimits) -> AgentSession:
        """A new episode's session; its ``base_url`` and ``api_key`` go to the agent."""
        key = secrets.token_urlsafe(16)
        session = AgentSession(
            key=key, base_url=f"{self.url}/sessions/{key}/v1", api_key=self.api_key, prompt_id=str(prompt_id),
            seed=seed, limits=limits, engine=self.engine, sampling=self.sampling, model_name=self.model_name,
            max_episode_tokens=self.max_episode_tokens, max_observation_tokens=self.max_observation_tokens,
            stop_token_ids=self._stop_ids, on_close=self._forget,
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
            return JSONResponse(err.body(), status_code=err.status, headers=_NO_RETRY)

        @app.post("/sessions/{key}/v1/chat/completions")
        async def chat_completions(key: str, request: Request) -> JSONResponse:
            session = self._session(key, request)
            try:
                body = json.loads(await request.body())
            except (ValueError, UnicodeDecodeError) as err:
                session.errors["invalid_json"] += 1
                raise RequestRefused(400, "invalid_json", f"the body is not JSON: {err}") from None
            return JSONResponse(await session.chat(body))

        @app.get("/sessions/{key}/v1/models")
        async def models(key: str, request: Request) -> JSONResponse:
            self._session(key, request)
            return JSONResponse(models_list(self.model_name, self._created))

        return app

    def _session(self, key: str, request: Request) -> AgentSession:
        """The open session ``key`` of an authorised request; raise (and count) ``RequestRefused``."""
        session = self._sessions.get(key) or self._closed.get(key)
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            if session is not None:
                session.errors["invalid_api_key"] += 1
            raise RequestRefused(401, "invalid_api_key", "missing or wrong API key: send the run's token as "
                                 "'Authorization: Bearer <api_key>' (the session's api_key).")
        if session is None:
            raise RequestRefused(404, "session_not_found", f"no agent session {key!r} on this endpoint; use the "
                                 "base_url of an open session.", type="not_found_error")
        if session.closed:
            refusal = closed_refusal()
            session.errors[refusal.code] += 1
            raise refusal
        return session


def _quiet_server(config: Any) -> Any:
    """A ``uvicorn.Server`` that leaves the process's signal handlers alone (it is not the main program)."""

    class QuietServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return QuietServer(config)
