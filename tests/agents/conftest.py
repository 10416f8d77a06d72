"""Fixtures of the agent endpoint tests: the torch engine on the tiny Llama, a scripted engine, a server."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import pytest

from flashrl.engines.base import ModelEngine
from flashrl.engines.types import Completion, Engine, SamplingConfig

MODEL = "tiny-policy"
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_tokens": 6}


@pytest.fixture(scope="module")
def torch_engine(tiny_llama_path: str):
    from flashrl.engines import make_engine

    with make_engine("torch", tiny_llama_path, seed=0, max_batch_size=4) as engine:
        yield engine


class ScriptedEngine(ModelEngine):
    """Answers call i with ``replies[i]`` (token ids, or a text to tokenise; log-prob -0.25 each; an
    exception is raised) once ``gate`` is set (None: at once), and records every request."""

    def __init__(self, tokenizer: Any, replies: Sequence[str | list[int] | Exception], max_model_len: int = 4096,
                 gate: asyncio.Event | None = None) -> None:
        self._tokenizer = tokenizer
        self._replies = list(replies)
        self._max_model_len = max_model_len
        self._version = 3
        self._gate = gate
        self.requests: list[tuple[list[int], SamplingConfig]] = []

    async def generate(self, prompt_token_ids: list[int], sampling: SamplingConfig) -> Completion:
        self.check_prompt(prompt_token_ids)
        self.requests.append((list(prompt_token_ids), sampling))
        reply = self._replies[len(self.requests) - 1]
        if self._gate is not None:
            await self._gate.wait()
        if isinstance(reply, Exception):
            raise reply
        ids = reply if isinstance(reply, list) else self._tokenizer(reply, add_special_tokens=False)["input_ids"]
        stopped = bool(ids) and ids[-1] in sampling.stop_token_ids
        return Completion(token_ids=ids, logprobs=[-0.25] * len(ids), finish_reason="stop" if stopped else "length",
                          version=3)

    async def update_weights(self, weights: Any, version: int) -> None:
        raise NotImplementedError("a scripted engine has no weights")

    def close(self) -> None:
        pass


@pytest.fixture
def scripted_engine(tokenizer: Any) -> Callable[..., ScriptedEngine]:
    """``scripted_engine(replies, max_model_len=4096, gate=None)``: a `ScriptedEngine` with SmolLM2's tokenizer."""
    return lambda replies, **options: ScriptedEngine(tokenizer, replies, **options)


@pytest.fixture(scope="session")
def tokenizer(tiny_llama_path: str) -> Any:
    """SmolLM2's tokenizer and chat template (the tiny Llama's)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_path)


def _serve(engine: Engine, scenario: Callable[[Any], Awaitable[Any]], **options: Any) -> Any:
    """Run ``scenario(server)`` in a fresh event loop against a started ``AgentServer`` of ``engine``."""
    from flashrl.agents import AgentServer

    async def main() -> Any:
        server = AgentServer(engine, **{"sampling": SAMPLING, "max_episode_tokens": 512, "model_name": MODEL,
                                        **options})
        await server.start()
        first = len(_OPEN_CLIENTS)
        try:
            return await scenario(server)
        finally:
            # the scenario's clients close on this loop: one garbage-collected later schedules its close on
            # whatever loop runs then (openai's __del__), and a later test's log check sees "Event loop is closed"
            while len(_OPEN_CLIENTS) > first:
                await _OPEN_CLIENTS.pop().close()
            await server.stop()

    return asyncio.run(main())


_OPEN_CLIENTS: list[Any] = []
"""The clients `_client` made; `_serve` closes those its scenario made before its loop ends."""


def _client(session: Any, **options: Any) -> Any:
    """The real ``openai`` client an agent would use (no retries: a refusal is seen once)."""
    import openai

    client = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0, **options)
    _OPEN_CLIENTS.append(client)
    return client


@pytest.fixture
def serve() -> Callable[..., Any]:
    """``serve(engine, scenario, **server_options)``: run ``scenario(server)`` against a started server
    (model ``tiny-policy``, temperature 1, max_tokens 6, max_episode_tokens 512 unless given)."""
    return _serve


@pytest.fixture
def agent_client() -> Callable[..., Any]:
    """``agent_client(session)``: the real ``openai.AsyncOpenAI`` on the session, without retries."""
    return _client


async def _stop_string_scenario(server: Any, client: Callable[..., Any]) -> dict[str, Any]:
    """Two sessions of the same seed: the first samples freely, the second with a stop string taken from the
    first's reply (the text of its third sampled token). Returns both replies, the stop string, the free
    call's sampled ids and the stopped session's recorded ids, and the stopped session's tito mismatches
    after it sends its reply back."""
    from flashrl.agents import AgentLimits

    user = [{"role": "user", "content": "What is 2 + 3?"}]
    free = server.open_session(prompt_id="p", seed=11, limits=AgentLimits())
    r1 = await client(free).chat.completions.create(model=server.model_name, messages=user, max_tokens=6)
    free_ids = [t for t, sampled in zip(*_ids_and_mask(free)) if sampled]
    tok = server.engine.tokenizer
    texts = [tok.decode(free_ids[:k], skip_special_tokens=True) for k in range(len(free_ids) + 1)]
    k = next(k for k in range(3, len(free_ids) + 1) if texts[k] != texts[k - 1] and texts[k][len(texts[k - 1]):].strip())
    stop = texts[k][len(texts[k - 1]):].strip()
    stopped = server.open_session(prompt_id="p", seed=11, limits=AgentLimits())
    agent = client(stopped)
    r2 = await agent.chat.completions.create(model=server.model_name, messages=user, max_tokens=6, stop=[stop])
    stopped_ids = [t for t, sampled in zip(*_ids_and_mask(stopped)) if sampled]
    back = [*user, r2.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "And?"}]
    await agent.chat.completions.create(model=server.model_name, messages=back, max_tokens=2)
    return {"free": r1, "stopped": r2, "stop": stop, "free_ids": free_ids, "stopped_ids": stopped_ids,
            "texts": texts, "mismatches": stopped.tito_mismatches, "segments": stopped.num_segments}


def _ids_and_mask(session: Any) -> tuple[list[int], list[bool]]:
    episode = session.to_episode(reward=0.0)
    return episode.token_ids, episode.loss_mask


def check_stop_string(result: dict[str, Any]) -> None:
    """What `_stop_string_scenario` must give: the stopped call's ids are the free call's up to the first token
    whose text completes the stop string (vLLM's rule), its reply the text before the stop, finish "stop", and
    the reply sent back continues the segment token-exactly."""
    stop, texts, free_ids = result["stop"], result["texts"], result["free_ids"]
    first = next(k for k in range(1, len(texts)) if stop in texts[k])
    assert result["stopped_ids"] == free_ids[:first]
    assert result["stopped"].choices[0].finish_reason == "stop"
    assert result["stopped"].choices[0].message.content == (texts[first][: texts[first].find(stop)] or None)
    assert result["mismatches"] == 0 and result["segments"] == 1


@pytest.fixture
def stop_string_check() -> Callable[..., Any]:
    """``await stop_string_check(server, agent_client)``: `_stop_string_scenario` checked by `check_stop_string`."""

    async def run(server: Any, client: Callable[..., Any]) -> dict[str, Any]:
        result = await _stop_string_scenario(server, client)
        check_stop_string(result)
        return result

    return run
