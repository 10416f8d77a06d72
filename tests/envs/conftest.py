"""Fixtures of the environment tests."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path: str) -> Any:
    """SmolLM2-135M-Instruct's tokenizer (with its ChatML chat template)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="session")
def qwen3_tokenizer() -> Any:
    """Qwen3's tokenizer with its own chat template (the built-in ``qwen3-tokenizer``)."""
    from transformers import AutoTokenizer

    from flashrl.models import resolve_tokenizer

    return AutoTokenizer.from_pretrained(resolve_tokenizer("qwen3-tokenizer"))


@pytest.fixture(scope="session")
def qwen25_tokenizer(qwen3_tokenizer: Any) -> Any:
    """Qwen's tokenizer with Qwen2.5-Instruct's chat template (``data/qwen2_5_instruct_chat_template.jinja``)."""
    tok = copy.deepcopy(qwen3_tokenizer)
    tok.chat_template = (Path(__file__).parent / "data" / "qwen2_5_instruct_chat_template.jinja").read_text()
    return tok
