"""Fixtures of the environment tests."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path: str) -> Any:
    """SmolLM2-135M-Instruct's tokenizer (with its ChatML chat template)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)
