"""The memory formulas, with numbers computed by hand."""

from __future__ import annotations

from flashrl.recipes.architectures import Architecture
from flashrl.recipes.memory import env_runner_memory, format_bytes, learner_memory

# P = embed 10x8 (tied) + 2 x (attention 4 x 8x8 + mlp 3 x 8x16 + norms 2x8) + final norm 8
ARCH = Architecture("toy", "llama", 2, 8, 16, 2, 2, 4, 10, True, 4096)
P = 80 + 2 * (256 + 384 + 16) + 8


def test_toy_parameter_count() -> None:
    assert ARCH.num_parameters() == P == 1400


def test_learner_bf16_adamw_with_checkpointing() -> None:
    m = learner_memory(
        ARCH,
        dtype="bfloat16",
        optimizer="adamw",
        train_batch_size=5,
        num_learners=2,
        max_episode_tokens=100,
        gradient_checkpointing=True,
        logprob_chunk_size=7,
    )
    assert m.tokens == 3 * 100  # ceil(5 / 2) rows, padded to the episode budget
    assert (m.weights, m.gradients, m.master, m.optimizer) == (2 * P, 2 * P, 8 * P, 8 * P)
    assert m.activations == 300 * 8 * 2 * 2 + 300 * 8 * 2 + 7 * 10 * 4 * 3
    assert m.total == 20 * P + m.activations


def test_learner_fp32_sgd_without_checkpointing() -> None:
    m = learner_memory(
        ARCH,
        dtype="float32",
        optimizer="sgd",
        train_batch_size=4,
        num_learners=0,
        max_episode_tokens=10,
        gradient_checkpointing=False,
        logprob_chunk_size=1,
    )
    assert (m.weights, m.gradients, m.master, m.optimizer) == (4 * P, 4 * P, 0, 0)
    per_token_layer = 6 * 8 + 3 * 16
    assert m.activations == 40 * per_token_layer * 2 * 4 + 40 * 8 * 4 + 1 * 10 * 4 * 3


def test_env_runner_weights_and_kv_cache() -> None:
    m = env_runner_memory(ARCH, engine_dtype="bfloat16", episodes_in_flight=3, max_episode_tokens=50)
    assert m.kv_bytes_per_token == 2 * 2 * 2 * 4 * 2
    assert (m.weights, m.kv_cache) == (2 * P, 3 * 50 * 64)
    assert m.total == 2 * P + 9600


def test_format_bytes() -> None:
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 * 1024**3) == "3.00 GiB"
    assert format_bytes(12) == "12 B"
