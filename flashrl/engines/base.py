"""What the flashrl engines share beyond the ``Engine`` contract: the state every one of them keeps."""

from __future__ import annotations

from typing import Any

from flashrl.engines.types import Engine

__all__ = ["ModelEngine"]


class ModelEngine(Engine):
    """An ``Engine`` serving one model from this process: the contract's read-only properties come
    from what the constructor sets (``_version``, ``_tokenizer``, ``_max_model_len``)."""

    _version: int
    _tokenizer: Any
    _max_model_len: int

    @property
    def version(self) -> int:
        return self._version

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return self._max_model_len
