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
        try:
            return await scenario(server)
        finally:
            await server.stop()

    return asyncio.run(main())


def _client(session: Any, **options: Any) -> Any:
    """The real ``openai`` client an agent would use (no retries: a refusal is seen once)."""
    import openai

    return openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0, **options)


@pytest.fixture
def serve() -> Callable[..., Any]:
    """``serve(engine, scenario, **server_options)``: run ``scenario(server)`` against a started server
    (model ``tiny-policy``, temperature 1, max_tokens 6, max_episode_tokens 512 unless given)."""
    return _serve


@pytest.fixture
def agent_client() -> Callable[..., Any]:
    """``agent_client(session)``: the real ``openai.AsyncOpenAI`` on the session, without retries."""
    return _client
