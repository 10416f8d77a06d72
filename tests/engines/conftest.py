"""Helpers shared by the engine tests."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

QUESTIONS = [
    "What is 12 + 7?",
    "Name a colour of the sky.",
    "Write one word that rhymes with cat.",
    "What is the capital of France?",
    "Count from one to five.",
    "What is 3 times 4?",
    "Say hello in Spanish.",
    "Is water wet? Answer briefly.",
]


def _chat_prompts(tokenizer, n: int = len(QUESTIONS)) -> list[list[int]]:
    return [
        list(tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False
        ))
        for q in QUESTIONS[:n]
    ]  # fmt: skip


@pytest.fixture(scope="session")
def chat_prompts():
    """``chat_prompts(tokenizer, n=8)``: chat-formatted prompt token ids of the first n questions."""
    return _chat_prompts


@pytest.fixture(scope="module")
def event_loop_runner() -> Iterator[asyncio.AbstractEventLoop]:
    """One event loop per module: vLLM's async engine stays bound to the loop that first used it."""
    loop = asyncio.new_event_loop()
    yield loop
    pending = asyncio.all_tasks(loop)  # e.g. vLLM's output handler, cancelled by engine.close()
    for task in pending:
        task.cancel()
    if pending:  # gather() of nothing would make a future on another loop (no test of the module ran one)
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.close()
