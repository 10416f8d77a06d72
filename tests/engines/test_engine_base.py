"""`ModelEngine`: the state both flashrl engines keep is read through one set of properties."""

from __future__ import annotations

import pytest

from flashrl.engines.base import ModelEngine
from flashrl.engines.torch_engine import TorchEngine
from flashrl.engines.vllm_engine import VLLMEngine

PROPERTIES = ("version", "tokenizer", "max_model_len")


@pytest.mark.parametrize("cls", [TorchEngine, VLLMEngine])
def test_each_engine_reads_its_state_through_the_shared_properties(cls: type[ModelEngine]) -> None:
    assert issubclass(cls, ModelEngine)
    assert [name for name in PROPERTIES if name in vars(cls)] == []  # declared once, in ModelEngine
    engine = cls.__new__(cls)  # no model, no vLLM: only the attributes the constructor would set
    engine._version, engine._tokenizer, engine._max_model_len = 7, "a tokenizer", 4096
    assert (engine.version, engine.tokenizer, engine.max_model_len) == (7, "a tokenizer", 4096)
