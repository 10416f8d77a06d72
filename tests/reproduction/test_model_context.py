"""`qwen_math`'s 6,144-token context on Qwen2.5-Math-1.5B, whose config says 4,096.

The reference requires a model config that allows 6,144 tokens and Molt hands vLLM that context as it
is; vLLM refuses a longer context than the config's at engine start. The experiment states the config
change (`hf_overrides`), and the plan refuses a context no config allows instead of warning.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from flashrl.plan.architectures import ARCHITECTURES
from flashrl.recipes.plan import _context_problem
from flashrl.reproduction.experiments import QWEN_MATH_CONTEXT, resolve_experiment
from flashrl.reproduction.translate import flashrl_fields

ARCH = ARCHITECTURES["Qwen/Qwen2.5-Math-1.5B"]


def test_the_experiment_overrides_the_model_context_with_its_provenance() -> None:
    assert ARCH.max_position_embeddings == 4096 < QWEN_MATH_CONTEXT == 6144
    fields = flashrl_fields(resolve_experiment("qwen_math"))
    assert fields.values["max_episode_tokens"] == 6144
    assert fields.values["engine_options"]["engine_args"] == {"hf_overrides": {"max_position_embeddings": 6144}}
    source = fields.sources["engine_options.engine_args"]
    assert "examples/settings/qwen2p5_math_1p5b_dapo_math.json notes" in source
    assert "molt/cli/train_rl_ray.py" in source and "RoPE unchanged" in source
    # the other experiments' models allow their contexts: no override
    for name in ("r1", "qwen7b_tool", "alfworld"):
        assert "hf_overrides" not in flashrl_fields(resolve_experiment(name)).values["engine_options"].get("engine_args", {})


def _config(engine_args: dict, tokens: int = 6144, engine: str = "vllm") -> SimpleNamespace:
    return SimpleNamespace(engine=engine, engine_options={"engine_args": engine_args}, max_episode_tokens=tokens)


def test_the_plan_refuses_a_context_the_model_config_does_not_allow() -> None:
    problem = _context_problem(_config({}), ARCH)
    assert problem is not None and "max_episode_tokens=6144 exceeds the model's max_position_embeddings=4096" in problem
    assert "'hf_overrides': {'max_position_embeddings': 6144}" in problem
    assert _context_problem(_config({"hf_overrides": {"max_position_embeddings": 6144}}), ARCH) is None
    assert _context_problem(_config({"hf_overrides": {"max_position_embeddings": 5000}}), ARCH) is not None
    assert _context_problem(_config({}, tokens=4096), ARCH) is None
    assert _context_problem(_config({}, engine="torch"), ARCH) is None  # transformers has no such limit


def test_the_math_preset_plans_without_a_context_error(capsys: pytest.CaptureFixture[str]) -> None:
    from flashrl.cli import main

    code = main(["train", "qwen25_math_1p5b", "--dry-run"])
    out, _ = capsys.readouterr()
    assert code == 0 and "exceeds the model's max_position_embeddings" not in out
    assert "hf_overrides" in out


@pytest.mark.vllm
def test_vllm_accepts_the_context_only_with_the_override(tmp_path) -> None:
    """vLLM's own check (`ModelConfig`, no engine started) on a model whose config allows 256 tokens."""
    from vllm.engine.arg_utils import EngineArgs

    from flashrl.models.tiny import build_tiny_llama

    path = build_tiny_llama(tmp_path / "short", max_position_embeddings=256)
    with pytest.raises(ValueError, match="VLLM_ALLOW_LONG_MAX_MODEL_LEN"):
        EngineArgs(model=path, max_model_len=384).create_model_config()
    config = EngineArgs(model=path, max_model_len=384, hf_overrides={"max_position_embeddings": 384}).create_model_config()
    assert config.max_model_len == 384 and config.hf_config.max_position_embeddings == 384
