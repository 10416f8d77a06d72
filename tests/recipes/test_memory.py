"""The memory formulas, with numbers computed by hand."""

from __future__ import annotations

import json
from pathlib import Path

from flashrl.recipes.architectures import Architecture
from flashrl.recipes.memory import env_runner_memory, format_bytes, layer_values_per_token, learner_memory

# P = embed 10x8 (tied) + 2 x (attention 4 x 8x8 + mlp 3 x 8x16 + norms 2x8) + final norm 8
ARCH = Architecture("toy", "llama", 2, 8, 16, 2, 2, 4, 10, True, 4096)
P = 80 + 2 * (256 + 384 + 16) + 8
MEASURED = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "learner_memory.json"


def test_toy_parameter_count() -> None:
    assert ARCH.num_parameters() == P == 1400


A = 4 * 8 + 3 * 8 + 2 * 8 + 4 * 16  # per-token values of one layer: 4H + 3q + 2kv + 4I = 136


def test_layer_values_per_token() -> None:
    assert layer_values_per_token(ARCH) == A == 136
    # MoE, 4 experts of width 16, 2 per token: 4kI + 2kH + E replaces 4I
    moe = Architecture("toy-moe", "qwen3_moe", 2, 8, 16, 2, 2, 4, 10, True, 4096, num_experts=4,
                       num_experts_per_token=2)
    assert layer_values_per_token(moe) == 4 * 8 + 3 * 8 + 2 * 8 + (4 * 2 * 16 + 2 * 2 * 8 + 4) == 236


def test_one_learner_fp32_sgd_one_padded_pass_without_checkpointing() -> None:
    m = learner_memory(ARCH, dtype="float32", optimizer="sgd", train_batch_size=4, num_learners=0,
                       max_episode_tokens=10, gradient_checkpointing=False, logprob_chunk_size=1)
    assert (m.weights, m.gradients, m.master, m.optimizer, m.host) == (4 * P, 4 * P, 0, 0, 0)
    assert m.tokens == 40 and not m.sharded
    assert m.layer_activations == 40 * 2 * A * 4  # M x L x a x b
    assert m.head_activations == 40 * 8 * (8 + 4) + 3 * 1 * 10 * 4 + 10 * 8 * 4
    assert m.total == 8 * P + 43520 + 4280


def test_one_learner_bf16_adamw_micro_batches_with_checkpointing() -> None:
    m = learner_memory(ARCH, dtype="bfloat16", optimizer="adamw", train_batch_size=4, num_learners=1,
                       max_episode_tokens=10, gradient_checkpointing=True, logprob_chunk_size=7,
                       max_tokens_per_micro_batch=15)
    assert m.tokens == 15  # the budget, not the batch's 40 tokens
    assert (m.weights, m.gradients, m.master, m.optimizer) == (2 * P, 2 * P, 8 * P, 8 * P)
    # checkpointed inputs of both layers + one layer recomputed in the backward pass
    assert m.layer_activations == 15 * 2 * 8 * 2 + 15 * A * 2 == 4560
    # final norm in/out + float32 hidden gradient; 3 chunks of 7 x V float32; the head accumulator and its cast
    assert m.head_activations == 15 * 8 * (4 + 4) + 3 * 7 * 10 * 4 + 10 * 8 * 4 + 10 * 8 * 2 == 2280


def test_a_pass_holds_at_least_one_whole_episode_and_at_most_the_learners_share() -> None:
    common = {"dtype": "float32", "optimizer": "adamw", "train_batch_size": 4, "num_learners": 2, "max_episode_tokens": 10,
                  "gradient_checkpointing": True, "logprob_chunk_size": 4}
    assert learner_memory(ARCH, max_tokens_per_micro_batch=3, **common).tokens == 10  # one episode over budget
    assert learner_memory(ARCH, max_tokens_per_micro_batch=1000, **common).tokens == 20  # 2 rows per learner
    flat = {learner_memory(ARCH, **{**common, "train_batch_size": b}, max_tokens_per_micro_batch=10).activations
            for b in (2, 8, 64)}
    assert len(flat) == 1  # under a budget the activations do not grow with the batch


def test_fsdp2_shards_the_static_state_over_the_learners() -> None:
    common = {"dtype": "bfloat16", "optimizer": "adamw", "train_batch_size": 5, "num_learners": 2, "max_episode_tokens": 100,
                  "gradient_checkpointing": True, "logprob_chunk_size": 7, "max_tokens_per_micro_batch": 150}
    root, layer = 10 * 8 + 8, (P - 88) // 2  # embeddings (tied) + final norm; one decoder layer = 656
    m = learner_memory(ARCH, **common)
    assert m.sharded and m.tokens == 150  # ceil(5 / 2) = 3 rows of 100 tokens, passes of <= 150
    assert m.weights == (root + 2 * layer) * 2 == 2800  # gathered root + running and prefetched layer
    assert (m.master, m.optimizer) == (700 * 4, 700 * 8)  # P / W float32 shards, AdamW's two moments
    assert m.gradients == 700 * 4 + (root + layer) * 2  # float32 shards + unsharded root and one layer
    assert m.layer_activations == 150 * 2 * 8 * 2 + 150 * A * 2
    offloaded = learner_memory(ARCH, optimizer_offload=True, **common)
    assert offloaded.host == 700 * 4 * 4  # master + gradient shards + two moments
    assert (offloaded.master, offloaded.optimizer, offloaded.gradients) == (0, 0, (root + layer) * 2)
    assert offloaded.total == m.total - offloaded.host


def test_formula_against_the_committed_measurement() -> None:
    """benchmarks/learner_memory.py's points: the update's transient bytes within 30% of the prediction."""
    result = json.loads(MEASURED.read_text())
    mm, cfg = result["model"], result["config"]
    arch = Architecture("benchmark", "qwen2", mm["num_hidden_layers"], mm["hidden_size"], mm["intermediate_size"],
                        mm["num_attention_heads"], mm["num_key_value_heads"],
                        mm["hidden_size"] // mm["num_attention_heads"], mm["vocab_size"], mm["tie_word_embeddings"],
                        mm["max_position_embeddings"])
    checked = 0
    for row in result["rows"]:
        for path, budget in (("single_pass", None), ("micro_packed", cfg["budget"])):
            measured = row[path]["peak_bytes"]
            m = learner_memory(arch, dtype="float32", optimizer="adamw", train_batch_size=row["batch_size"],
                               num_learners=1, max_episode_tokens=cfg["length"],
                               gradient_checkpointing=cfg["gradient_checkpointing"],
                               logprob_chunk_size=cfg["chunk_size"], max_tokens_per_micro_batch=budget)
            assert abs(m.gradients + m.activations - measured) <= 0.3 * measured, (row["batch_size"], path)
            checked += 1
    assert checked >= 8


def test_env_runner_weights_and_kv_cache() -> None:
    m = env_runner_memory(ARCH, engine_dtype="bfloat16", episodes_in_flight=3, max_episode_tokens=50)
    assert m.kv_bytes_per_token == 2 * 2 * 2 * 4 * 2
    assert (m.weights, m.kv_cache) == (2 * P, 3 * 50 * 64)
    assert m.total == 2 * P + 9600


def test_format_bytes() -> None:
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 * 1024**3) == "3.00 GiB"
    assert format_bytes(12) == "12 B"


def test_checkpoint_host_memory_per_save_path(monkeypatch) -> None:
    from flashrl.recipes import memory

    one = memory.checkpoint_memory(ARCH, dtype="float32", optimizer="adamw", num_learners=0)
    assert (one.layout, one.per_rank, one.export) == ("single_file", P * 12, P * 4)  # full state; the export
    bf16 = memory.checkpoint_memory(ARCH, dtype="bfloat16", optimizer="adamw", num_learners=1)
    assert (bf16.per_rank, bf16.export) == (P * 12 + P * 2, P * 2)  # + the bf16 weights' copy
    monkeypatch.setattr(memory, "EXPORT_BUCKET_BYTES", 100)
    sharded = memory.checkpoint_memory(ARCH, dtype="bfloat16", optimizer="adamw", num_learners=2)
    # each rank its shard (700 master + 2 x 700 moments, float32); rank 0 two buckets of one layer
    assert (sharded.layout, sharded.per_rank, sharded.export) == ("dcp", 700 * 12, 2 * 656 * 2)
    assert sharded.rank0 == 700 * 12 + 2624
    sgd = memory.checkpoint_memory(ARCH, dtype="float32", optimizer="sgd", num_learners=2, export_policy=False)
    assert (sgd.per_rank, sgd.export) == (700 * 4, 0)


def test_the_plan_uses_the_export_bucket_of_the_learners() -> None:
    from flashrl.learners.fsdp import EXPORT_BUCKET_BYTES
    from flashrl.recipes.memory import EXPORT_BUCKET_BYTES as PLANNED

    assert PLANNED == EXPORT_BUCKET_BYTES
