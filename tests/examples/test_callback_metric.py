"""examples/extending/callback_metric.py on the tiny model: its metrics reach the result, its rule stops."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "extending" / "callback_metric.py"

pytestmark = pytest.mark.ray


def _example():
    spec = importlib.util.spec_from_file_location("callback_metric_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not in sys.modules: its class travels to the actors by value
    return module


def test_the_example_logs_its_metrics_and_its_callback_stops_the_run(ray_cluster, tiny_llama_path, capsys):
    results = _example().run(["--model", tiny_llama_path, "--iterations", "3", "--stop-answer-rate", "0.0"])
    assert len(results) == 1 and results[0]["should_stop"] is True  # rate >= 0 always: stopped after one
    result = results[0]
    # 16 tokens per turn at most, one turn per episode: the runners' values, reduced once.
    assert 0 < result["callbacks/reply_tokens_mean"] <= result["callbacks/reply_tokens_max"] <= 16
    assert 0.0 <= result["callbacks/answer_rate"] <= 1.0
    out = capsys.readouterr().out
    assert "iteration 1: reply tokens mean" in out and "the callback stopped the run" in out
