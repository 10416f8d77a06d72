"""The worker's filter on vLLM's reload warnings: silent for layers no update carries, loud for the rest."""

from __future__ import annotations

import logging

import pytest

from flashrl.engines import vllm_worker


@pytest.fixture
def reload_records():
    logger = logging.getLogger(vllm_worker.RELOAD_LOGGER)
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep(level=logging.DEBUG)
    logger.addHandler(handler)
    try:
        yield logger, records
    finally:
        logger.removeHandler(handler)


def test_only_the_layers_without_weights_of_their_own_are_silenced(reload_records) -> None:
    logger, records = reload_records
    vllm_worker.install_reload_log_filter()
    vllm_worker.install_reload_log_filter()  # idempotent: one filter
    assert sum(isinstance(f, vllm_worker._NoWeightsOfTheirOwn) for f in logger.filters) == 1
    for layer in ("RotaryEmbedding", "Llama3RotaryEmbedding", "ParallelLMHead"):
        logger.warning("%s: Failed to load weights", layer)  # exactly vLLM's call (reload/layerwise.py)
    assert records == []
    logger.warning("%s: Failed to load weights", "QKVParallelLinear")  # a real failure still shows
    logger.warning("%s: something else", "RotaryEmbedding")
    assert [r.getMessage() for r in records] == [
        "QKVParallelLinear: Failed to load weights",
        "RotaryEmbedding: something else",
    ]
