"""The memory formulas, with numbers computed by hand."""

from __future__ import annotations

import json
from pathlib import Path

from flashrl.plan.architectures import Architecture
from flashrl.plan.memory import env_runner_memory, format_bytes, layer_values_per_token, learner_memory

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
    # the layer whose backward runs: 2H + max(3I, 2q + 2kv) = 16 + max(48, 32) gradient values per token
    assert m.backward_activations == 40 * 64 * 4 == 10240
    # sdpa, padded: 4 rows of a [10 x 10] boolean mask and SDPA's float32 copy of it
    assert m.mask == 4 * 10 * 10 * (1 + 4) == 2000
    assert m.activations == 43520 + 10240 + 2000 + 4280
    assert m.reduce_scatter == 0  # one learner: no FSDP
    assert m.push == 16 * 8 * 4  # shm: one full tensor at a time (the largest, an MLP projection)
    assert m.total == 8 * P + 43520 + 10240 + 2000 + 4280


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
    assert m.backward_activations == 15 * 64 * 2  # one layer's gradients, bfloat16
    assert m.mask == 1 * 10 * 10 * (1 + 2)  # padded passes of whole episodes: one row of 10 fits in 15
    packed = learner_memory(ARCH, dtype="bfloat16", optimizer="adamw", train_batch_size=4, num_learners=1,
                            max_episode_tokens=10, gradient_checkpointing=True, logprob_chunk_size=7,
                            max_tokens_per_micro_batch=15, pack_sequences=True)
    assert packed.mask == 15 * 15 * 3  # one packed row of 15 tokens: its mask spans all of them
    flash = learner_memory(ARCH, dtype="bfloat16", optimizer="adamw", train_batch_size=4, num_learners=1,
                           max_episode_tokens=10, gradient_checkpointing=True, logprob_chunk_size=7,
                           max_tokens_per_micro_batch=15, flash_attention=True)
    assert flash.mask == 0 and flash.activations == m.activations - m.mask


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
    # float32 reduce-scatter of the larger group (a layer, 656 > root 88): its input and its output shard
    assert m.reduce_scatter == 656 * 4 + 328 * 4 == 3936
    offloaded = learner_memory(ARCH, optimizer_offload=True, **common)
    assert offloaded.host == 700 * 4 * 4  # master + gradient shards + two moments
    assert (offloaded.master, offloaded.optimizer, offloaded.gradients) == (0, 0, (root + layer) * 2)
    assert offloaded.total == m.total - offloaded.host


def test_the_push_after_the_update_can_be_the_peak() -> None:
    """Push routes gather one bucket on the GPU and vLLM adds its packed buffers (1 GiB each): for a
    small model that is more than the update's gradients and activations."""
    common = {"dtype": "bfloat16", "optimizer": "adamw", "train_batch_size": 4, "num_learners": 1,
              "max_episode_tokens": 10, "gradient_checkpointing": True, "logprob_chunk_size": 4}  # fmt: skip
    shm = learner_memory(ARCH, **common)
    nccl = learner_memory(ARCH, weight_sync="nccl", bucket_bytes=100, **common)
    ipc = learner_memory(ARCH, weight_sync="ipc", bucket_bytes=100, **common)
    largest_tensor = 16 * 8 * 2  # an MLP projection in bfloat16
    assert nccl.push == max(100, 656 * 2) + 2 * (2**30 + largest_tensor)  # bucket: one layer (1312 B) > 100
    assert ipc.push == 656 * 2 + 2**30
    assert nccl.total == nccl.weights + nccl.master + nccl.optimizer + nccl.push > shm.total
    assert shm.total == shm.weights + shm.master + shm.optimizer + shm.update


def test_qwen3_moe_on_80_gb_gpus() -> None:
    """The MoE preset's learner (FSDP2 over 8, passes of one 16,384-token episode, nccl): 63 GiB of static
    state, the new terms on top of it, and an MoE layer's backward (3kI + kH + E for the MLP branch)."""
    from flashrl.plan.architectures import ARCHITECTURES
    from flashrl.plan.memory import GIB, layer_backward_values_per_token

    arch = ARCHITECTURES["Qwen/Qwen3-30B-A3B"]
    assert layer_backward_values_per_token(arch) == 2 * 2048 + (3 * 8 * 768 + 8 * 2048 + 128)
    m = learner_memory(arch, dtype="bfloat16", optimizer="adamw", train_batch_size=128, num_learners=8,
                       max_episode_tokens=16384, gradient_checkpointing=True, logprob_chunk_size=1024,
                       max_tokens_per_micro_batch=16384, weight_sync="nccl")  # fmt: skip
    assert 62 * GIB < m.static < 64 * GIB
    root = 151936 * 2048 * 2 + 2048  # untied embedding and head, final norm
    layer = (arch.num_parameters() - root) // 48
    assert m.reduce_scatter == layer * 4 + -(-layer // 8) * 4  # a layer (622M) outweighs the root
    assert m.mask == 16384 * 16384 * 3  # sdpa (no flash_attn): one padded row of 16,384
    assert 75 * GIB < m.total < 78 * GIB  # of 80 GiB: little room for the CUDA context and fragmentation


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
                               logprob_chunk_size=cfg["chunk_size"], max_tokens_per_micro_batch=budget,
                               pack_sequences=path == "micro_packed")
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
    from flashrl.plan import memory

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
    from flashrl.checkpoints.export import EXPORT_BUCKET_BYTES
    from flashrl.plan.memory import EXPORT_BUCKET_BYTES as PLANNED

    assert PLANNED == EXPORT_BUCKET_BYTES


PROCESSES = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "process_memory.json"


def _process_benchmark():
    """benchmarks/process_memory.py as a module: the measured run's config is its ``run_config``."""
    import importlib.util

    path = PROCESSES.parents[1] / "process_memory.py"
    spec = importlib.util.spec_from_file_location("process_memory_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cpu_runner_and_learner_estimates_against_the_committed_measurement() -> None:
    """The dry run's per-runner and learner totals within 30% of the processes' measured peak RSS
    (SmolLM2-135M on the CPU, a learner and an env runner as Ray actors, for each engine measured)."""
    from flashrl.plan import plan_run
    from flashrl.plan.memory import PROCESS_BYTES, VLLM_PROCESS_BYTES

    result = json.loads(PROCESSES.read_text())
    assert PROCESS_BYTES >= result["bare_worker"]["peak_rss_bytes"]  # the baseline every process starts from
    assert VLLM_PROCESS_BYTES >= result["bare_vllm_worker"]["peak_rss_bytes"]  # ... with vLLM imported
    bench = _process_benchmark()
    checked = []
    for engine, run in result["runs"].items():
        if "error" in run:
            continue
        config = bench.run_config(engine)
        config.validate()
        plan = plan_run(config)
        for role, estimate in (("env_runner", plan.runner_memory.total), ("learner", plan.learner_memory.total)):
            measured = run["measured"][role]["peak_rss_bytes"]
            assert abs(estimate - measured) <= 0.3 * measured, (engine, role, format_bytes(estimate),
                                                                format_bytes(measured))
            checked.append((engine, role))
            # the estimates docs/benchmarks.md quotes beside the measurement (MiB)
            quoted = {("torch", "env_runner"): 2184, ("torch", "learner"): 4605,
                      ("vllm", "env_runner"): 4543, ("vllm", "learner"): 4605}[engine, role]
            assert round(estimate / 2**20) == quoted, (engine, role, estimate)
    assert {(e, r) for e in ("torch", "vllm") for r in ("env_runner", "learner")} <= set(checked)


def test_lora_counts_a_frozen_base_and_a_float32_adapter_with_its_gradients_and_moments(tiny_llama_path) -> None:
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from flashrl.models.lora import LoRASettings
    from flashrl.plan.architectures import read_architecture
    from flashrl.plan.memory import adapter_parameters

    # the count matches what peft trains on a real model, for all-linear and for named layers
    arch = read_architecture(tiny_llama_path)
    for targets in ("all-linear", "q_proj,v_proj"):
        model = AutoModelForCausalLM.from_pretrained(tiny_llama_path)
        peft = get_peft_model(model, LoRASettings(rank=8, alpha=16.0, target_modules=targets).peft_config())
        assert adapter_parameters(arch, 8, targets) == sum(p.numel() for p in peft.parameters() if p.requires_grad)
    a = adapter_parameters(ARCH, 2)  # the toy: r (in + out) per layer: q, k, v, o 4 x 16, MLP 3 x 24
    assert a == 2 * 2 * (4 * 16 + 3 * 24) == 544
    m = learner_memory(ARCH, dtype="bfloat16", optimizer="adamw", train_batch_size=4, num_learners=1,
                       max_episode_tokens=10, gradient_checkpointing=False, logprob_chunk_size=1, lora_rank=2)
    full = learner_memory(ARCH, dtype="bfloat16", optimizer="adamw", train_batch_size=4, num_learners=1,
                          max_episode_tokens=10, gradient_checkpointing=False, logprob_chunk_size=1)
    assert (m.weights, m.gradients, m.master, m.optimizer) == (2 * P + 4 * a, 4 * a, 0, 8 * a)
    assert m.activations == full.activations and m.static < full.static and m.push == 4 * a
    # two sharded learners: half the frozen base (bf16) and half the adapter each, a unit of the base gathered
    # (the root 88 + two layers of 656 parameters), one layer's adapter gradients unsharded (a / 2 layers)
    two = learner_memory(ARCH, dtype="bfloat16", optimizer="adamw", train_batch_size=4, num_learners=2,
                         max_episode_tokens=10, gradient_checkpointing=False, logprob_chunk_size=1, lora_rank=2)
    assert two.sharded and (two.weights, two.master) == (700 * 2 + 272 * 4 + (88 + 2 * 656) * 2, 0)
    assert (two.gradients, two.optimizer, two.reduce_scatter) == (272 * 4 + 272 * 4, 2 * 272 * 4, 272 * 4 + 136 * 4)
    # a LoRA checkpoint is the adapter and its AdamW moments in float32, one file whatever the learners
    from flashrl.plan.memory import checkpoint_memory

    for learners in (1, 2):
        ck = checkpoint_memory(ARCH, dtype="bfloat16", optimizer="adamw", num_learners=learners, lora_rank=2)
        assert (ck.layout, ck.per_rank, ck.export) == ("single_file", a * 4 * 3, a * 4)
