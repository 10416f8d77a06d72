"""Memory estimates of a run: what one learner and one env runner hold, from the model's shape.

The formulas are a plan, not a profiler; each term follows what the code allocates, and the learner's
were checked against ``benchmarks/learner_memory.py`` (``docs/training.md``, "Learner memory"). With
P parameters, b the learner's dtype bytes, L layers, H hidden size, q = heads x head_dim,
kv = kv_heads x head_dim, I the MLP width, V vocabulary, W = num_learners:

Learner, static (``flashrl/learners/policies.py``)::

    one learner (W <= 1, LocalPolicy):
      weights     = P x b
      gradients   = P x b
      master      = P x 4 x 2      only when b < 4: float32 master weights + their float32 gradients
      optimizer   = P x 4 x 2      AdamW's two float32 moments (SGD: 0)
    W >= 2 learners (ShardedPolicy, FSDP2 per decoder layer + root, flashrl/learners/fsdp.py):
      master      = P / W x 4      the float32 parameter shards (the "weights" FSDP keeps)
      gradients   = P / W x 4      float32 gradient shards (reduce dtype float32)
                  + (R + P_l) x b  unsharded gradients before their reduce-scatter: the root's R
                                   parameters (embeddings, untied head, final norm; the root is not
                                   resharded between forward and backward) and one layer's P_l
      optimizer   = P / W x 4 x 2
      weights     = (R + 2 P_l) x b   gathered compute copies: the root, the running layer and the
                                   prefetched one
      optimizer_offload moves master, the gradient shards and the optimizer to host memory
      (CPUOffloadPolicy; ``host``), leaving the gathered copies and unsharded gradients on the GPU
      reduce_scatter = G x 4 x (1 + 1 / W)   G = max(R, P_l): FSDP2 reduces in float32, so the
                                   gradient group being reduced is cast to a float32 input buffer
                                   and reduced into a float32 output shard (``reduce_dtype``)

Learner, activations of ONE pass (``flashrl/learners/learner.py``: the batch's ceil(B / W) rows per
learner run in passes of at most ``max_tokens_per_micro_batch`` tokens, packed; a trajectory is
never split)::

    M = ceil(B / W) x T                           max_tokens_per_micro_batch None (one padded pass)
    M = min(ceil(B / W) x T, max(budget, T))      else (a lone trajectory of T tokens may exceed it)
    a = 4H + 3q + 2kv + 4I                        values one decoder layer saves per token for its
        backward: the two RMSNorms' input and output (4H), rotated queries, attention output and
        o_proj input (3q), keys and values (2kv), the MLP's gate, up, SiLU(gate) and product (4I);
        MoE (E experts, k per token, I the expert width): 4kI + 2kH + E instead of 4I (each token's
        k expert MLPs, its k gathered inputs and weighted outputs, the router logits)
    layers   = M x L x a x b                      without gradient checkpointing
             = M x L x H x b + M x a x b          with it: every layer's checkpointed input, plus the
                                                  one layer recomputed during the backward pass
    backward = M x g x b                          the gradients one layer's backward pass holds
        besides its saved values: the incoming and outgoing residual gradients (2H) and the larger
        branch's, g = 2H + max(3I, 2q + 2kv) (the MLP's product, gate and up gradients, or the
        attention output's and the query, key and value gradients); MoE: 3kI + kH + E for 3I
    mask     = r x t^2 x (1 + b)                  without flash attention: the 4-D mask of each of
        the pass's r rows of t tokens (padded: r = M / T rows of T; packed: one row of M), a boolean
        one from transformers and the additive copy SDPA makes of it in the compute dtype
    head     = M x H x (2b + 4)                   final norm's input and output, the float32
                                                  gradient of the hidden states
             + 3 x c x V x 4                      c = min(logprob_chunk_size, M): one chunk's float32
                                                  logits, probabilities and their gradient
             + V x H x 4 (+ V x H x b if b < 4)   the float32 head-gradient accumulator (and its cast)
                                                  of ``flashrl/ops/logprobs.py``
    activations = layers + backward + mask + head

Learner, weight push (after the update: the gradients and activations are gone, the static state
stays; ``flashrl/weight_sync``)::

    bucket  = max(bucket_bytes, the largest layer) in b   each rank gathers one bucket of full
                                                  tensors (push routes: on the GPU; shm: one full
                                                  tensor at a time on the GPU, the bucket in RAM)
    nccl    = 2 x (1 GiB + the largest tensor)    vLLM's two packed broadcast buffers, each filled
                                                  past 1 GiB by at most one tensor
    ipc     = max(1 GiB, the largest tensor)      vLLM's one reusable IPC buffer
    push    = bucket (+ nccl or ipc on learner rank 0)

    total   = weights + master + optimizer + max(gradients + activations + reduce_scatter, push)
              (+ process on the CPU: the learner's process besides its tensors, PROCESS_BYTES)

Measured (``benchmarks/learner_memory.py``, float32, 8 layers x 512, V = 151,936, T = 64, B = 4..64,
table in ``docs/training.md``): the update's transient bytes (gradients + activations) grow with B in
the single padded pass (1.0 -> 2.0 GiB) and stay flat under a 256-token budget (1.1 GiB); the formula
is within 24.4% of every point (B = 16, single pass: 1248 MiB predicted, 1004 measured;
``tests/plan/test_memory.py`` holds it within 30%). It is a sum, so
it over-predicts where phases do not overlap (the tied embedding's gradient sum at the end of the
backward pass comes after the layers' activations are freed) and under-predicts the accumulation's
temporary of a second pass by about 8.5% (B = 8..64 under the budget).

Checkpoint save, host memory (``flashrl/checkpoints/``; V x H the embedding, P_l one layer)::

    W >= 2 learners: sharded DCP (torch.distributed.checkpoint), every rank writes its own shard
      per rank    = P / W x (4 + 4 x m)   m = AdamW's 2 moments (SGD: 0): the master and optimizer
                                          shards pass through host memory on their way to the files
                                          (DCP copies each tensor to the host and writes it; the
                                          files' dirty pages stay in the page cache until fsync)
      rank 0 adds = 2 x max(X, P_l x b, V x H x b)   the Hugging Face export, streamed: one bucket of
                                          whole layers (X = EXPORT_BUCKET_BYTES) gathered, and its
                                          serialised safetensors copy
    W <= 1: one learner writes one file (torch.save of its full state)
      rank 0      = P x (4 + 4 x m) (+ P x b when b < 4)   CPU copies of the master weights and the
                                          optimizer state (and of the low-precision weights)
      rank 0 adds = P x b                 ``save_pretrained``'s serialised copy of the weights

The final checkpoint of a run always exports the policy; periodic ones do with
``checkpoint_export_policy`` (default on).

Env runner (one vLLM engine, split over its GPUs by tensor / expert parallelism)::

    weights  = P x e                   e = the engine's dtype bytes (bfloat16 on GPU, float32 on CPU)
    kv_cache = K x max_episode_tokens x 2 x L x kv_heads x head_dim x e
               (K episodes in flight, each at its full context budget: an upper bound)
    reserved = on vLLM's CPU build, the bytes the engine asks for: ``kv_cache_budget`` of
               ``flashrl/engines/memory.py`` (the same call the engine makes: whole blocks, a floor
               and a cap), or the engine options' ``kv_cache_memory_bytes``, or vLLM's own
               ``VLLM_CPU_KVCACHE_SPACE`` (GiB; it wins over both); on GPU the engine takes
               its ``gpu_memory_utilization`` share and the plan compares the need with it
    process  = on the CPU, the runner's processes besides the engine's tensors:
               torch engine  PROCESS_BYTES + 2 x P x e  the process, and the weights twice more: a
                             weight update's buckets, read from Ray's object store, stay mapped in
                             the runner's resident set (shared memory), and while the first update
                             is copied in, the model's safetensors file (mapped when the engine
                             built it) is still resident next to the weights being written
               vLLM          2 x VLLM_PROCESS_BYTES + 5 x P x e   two processes, the runner and
                             vLLM's engine core (which holds the weights and the KV cache), each
                             with vLLM imported, each peaking like a torch-engine runner: the
                             weights and an update's two more copies (the runner holds no weights
                             of its own but passes every update on: three copies; the engine core
                             two besides its weights, counted above). A fit to the measured peaks
                             (below), not a sampled breakdown of where those bytes sit
               (0 on a GPU: that estimate is of device memory)

Measured (``benchmarks/process_memory.py``, ``benchmarks/results/process_memory.json``, SmolLM2-135M
in float32 on the CPU, a learner and a torch-engine env runner as Ray actors, two iterations): a bare
worker (Python, torch, transformers, Ray's worker and flashrl imported, the tokenizer loaded) peaked
at 570 MiB; the runner at 2653 MiB (its process and a 57 MiB child), estimated 2184 MiB (0.82);
the learner at 3993 MiB, estimated 4605 MiB (1.15; its activations counted at the full 256-token
context, its episodes were about 57 tokens). With vLLM's CPU build (``runs.vllm``: its own bare
worker and load) the runner's process peaked at 2660 MiB and its engine-core child at 2937 MiB,
5597 MiB together, estimated 4542 MiB (0.81; the JSON's ``estimate_when_measured``, 1177 MiB, counted
the runner's process only); a bare worker with vLLM imported peaked at 663 MiB
(``bare_vllm_worker``). Without the process terms the runner's estimate was
558 MiB (weights and KV cache only). Where the runner's bytes sit was sampled from ``/proc``
during that run (``benchmarks/results/process_memory_rss_samples.log``: the update's bucket as
shared memory, the model's file pages, the anonymous weights). ``tests/plan/test_memory.py`` holds
both estimates within 30% of the measured peaks.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from typing import Any

from flashrl.engines.memory import (
    CPU_BLOCK_SIZE,
    GPU_BLOCK_SIZE,
    check_kv_cache_bytes,
    kv_bytes_per_token,
    kv_cache_budget,
)
from flashrl.plan.architectures import DTYPE_BYTES, Architecture
from flashrl.weight_sync.wire import DEFAULT_BUCKET_BYTES, VLLM_PACKED_BUFFER_BYTES  # no torch import

__all__ = [
    "CheckpointMemory",
    "EnvRunnerMemory",
    "LearnerMemory",
    "adapter_parameters",
    "checkpoint_memory",
    "env_runner_memory",
    "format_bytes",
    "layer_backward_values_per_token",
    "layer_values_per_token",
    "learner_flash_attention",
    "learner_memory",
    "learner_memory_for",
    "push_bytes",
    "runner_process_bytes",
]

GIB = 1024**3
MIB = 1024**2
PROCESS_BYTES = 600 * MIB
"""A flashrl worker process on the CPU before its model: Python, torch, transformers, Ray's worker and
flashrl imported, the tokenizer loaded (``benchmarks/results/process_memory.json``, ``bare_worker``:
570 MiB, rounded up)."""
VLLM_PROCESS_BYTES = 700 * MIB
"""``PROCESS_BYTES`` with vLLM's CPU build imported, each of a vLLM runner's two processes
(``benchmarks/results/process_memory.json``, ``bare_vllm_worker``: 663 MiB, rounded up)."""
EXPORT_BUCKET_BYTES = GIB
"""X of the module docstring: ``flashrl.checkpoints.export.EXPORT_BUCKET_BYTES`` (not imported: no torch here)."""


@dataclass(frozen=True)
class LearnerMemory:
    """Bytes one learner holds during an update (on its device; ``host`` is what it offloaded)."""

    weights: int
    gradients: int
    master: int
    optimizer: int
    activations: int
    tokens: int
    """Tokens in one learner's largest forward pass (M of the module docstring)."""
    layer_activations: int = 0
    """The decoder layers' part of ``activations`` (checkpointed inputs + one recomputed layer, or all)."""
    head_activations: int = 0
    """The final hidden states' and the chunked log-prob head's part of ``activations``."""
    host: int = 0
    """Bytes in host memory instead (optimizer_offload: master shards, gradient shards, optimizer)."""
    sharded: bool = False
    """Whether the static state is sharded over the learners (FSDP2, num_learners >= 2)."""
    backward_activations: int = 0
    """The gradients of the layer whose backward pass runs (part of ``activations``)."""
    mask: int = 0
    """The 4-D attention masks of one pass without flash attention (part of ``activations``)."""
    reduce_scatter: int = 0
    """FSDP2's float32 reduce-scatter buffers (sharded learners)."""
    push: int = 0
    """What a weight push adds on top of the weights, master copy and optimizer (after the update)."""
    process: int = 0
    """The learner's process besides its tensors (``PROCESS_BYTES``) on the CPU; 0 on a GPU, where the
    estimate is of device memory."""

    @property
    def static(self) -> int:
        return self.weights + self.gradients + self.master + self.optimizer

    @property
    def update(self) -> int:
        """Bytes beyond the weights, master and optimizer while an update runs."""
        return self.gradients + self.activations + self.reduce_scatter

    @property
    def total(self) -> int:
        """The peak: the update or the push after it, whichever holds more (and the process on the CPU)."""
        return self.weights + self.master + self.optimizer + max(self.update, self.push) + self.process


@dataclass(frozen=True)
class EnvRunnerMemory:
    """Bytes one env runner's engine holds (over all its GPUs)."""

    weights: int
    kv_cache: int
    """What the episodes in flight hold at their full context budget."""
    kv_bytes_per_token: int
    kv_cache_reserved: int | None = None
    """KV-cache bytes the engine reserves when it reserves a fixed number (vLLM's CPU build)."""
    process: int = 0
    """The runner's processes besides the engine's tensors, on the CPU (``runner_process_bytes``); 0 on
    a GPU, where the estimate is of device memory."""

    @property
    def total(self) -> int:
        kv = self.kv_cache if self.kv_cache_reserved is None else self.kv_cache_reserved
        return self.weights + kv + self.process


def learner_memory_for(config: Any, arch: Architecture, *, weight_sync: str) -> LearnerMemory:
    """``learner_memory`` of an algorithm config's learner settings (the dry-run's and the colocated
    engine's estimate); flash attention judged on this machine (``learner_flash_attention``)."""
    return learner_memory(
        arch,
        dtype=config.dtype,
        optimizer=config.optimizer,
        train_batch_size=config.train_batch_size,
        num_learners=config.num_learners,
        max_episode_tokens=config.max_episode_tokens,
        gradient_checkpointing=config.gradient_checkpointing,
        logprob_chunk_size=config.logprob_chunk_size,
        max_tokens_per_micro_batch=config.max_tokens_per_micro_batch,
        optimizer_offload=config.optimizer_offload,
        flash_attention=learner_flash_attention(config),
        pack_sequences=config.pack_sequences,
        weight_sync=weight_sync,
        process_bytes=PROCESS_BYTES if config.num_gpus_per_learner == 0 else 0,
        lora_rank=getattr(config, "lora_rank", None),
        lora_target_modules=getattr(config, "lora_target_modules", "all-linear"),
    )


def learner_flash_attention(config: Any) -> bool:
    """Whether the learners attend with flash attention: bfloat16 on a GPU with ``flash_attn`` installed
    (``flashrl.learners.policies.attention_implementation``), judged on the machine making the plan."""
    return (
        config.num_gpus_per_learner > 0
        and config.dtype == "bfloat16"
        and importlib.util.find_spec("flash_attn") is not None
    )


def adapter_parameters(arch: Architecture, rank: int, target_modules: str = "all-linear") -> int:
    """Parameters of a LoRA adapter of ``rank``: ``rank * (in + out)`` per adapted linear layer.

    ``all-linear`` adapts the attention projections and, in a dense model, the MLP's three; fused MoE
    experts are not linear layers (LoRA refuses them), so an MoE model's MLP is left out.
    """
    h, q, kv = arch.hidden_size, arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    i = arch.intermediate_size
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
    if not arch.is_moe:
        shapes.update(gate_proj=(h, i), up_proj=(h, i), down_proj=(i, h))
    names = list(shapes) if target_modules == "all-linear" else [t.strip() for t in target_modules.split(",")]
    return arch.num_layers * sum(rank * sum(shapes[n]) for n in names if n in shapes)


def learner_memory(
    arch: Architecture,
    *,
    dtype: str,
    optimizer: str,
    train_batch_size: int,
    num_learners: int,
    max_episode_tokens: int,
    gradient_checkpointing: bool,
    logprob_chunk_size: int,
    max_tokens_per_micro_batch: int | None = None,
    optimizer_offload: bool = False,
    flash_attention: bool = False,
    pack_sequences: bool | None = None,
    weight_sync: str = "shm",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    process_bytes: int = 0,
    lora_rank: int | None = None,
    lora_target_modules: str = "all-linear",
) -> LearnerMemory:
    """The learner formula of the module docstring (``num_learners`` 0 means one learner in the driver).

    ``flash_attention``: the learner attends with a varlen flash kernel (no 4-D masks);
    ``pack_sequences`` as the learner's (None: packed only with flash attention); ``weight_sync``
    and ``bucket_bytes``: the route and bucket size of the weight push; ``process_bytes``: the
    process's own memory, counted in ``total`` (``PROCESS_BYTES`` for a learner on the CPU). ``lora_rank``:
    the base is frozen in the compute dtype (no gradient, master or optimizer state) and the adapter
    (``adapter_parameters``) is float32 with its gradients and optimizer state; sharded, each rank holds
    1/W of both and gathers a unit of the base (two layers and the root) as full training does.
    """
    p = arch.num_parameters()
    b = DTYPE_BYTES[dtype]
    world = max(1, num_learners)
    moments = 2 if optimizer == "adamw" else 0
    host, reduce_scatter = 0, 0
    root = arch.vocab_size * arch.hidden_size * (1 if arch.tie_word_embeddings else 2) + arch.hidden_size
    layer = (p - root) // max(1, arch.num_layers)
    adapter = 0
    if lora_rank is not None and world == 1:
        adapter = adapter_parameters(arch, int(lora_rank), lora_target_modules)
        weights, gradients, master = p * b + adapter * 4, adapter * 4, 0
        optimizer_bytes = adapter * 4 * moments
    elif lora_rank is not None:  # sharded: frozen base shards in the compute dtype, float32 adapter shards
        adapter = adapter_parameters(arch, int(lora_rank), lora_target_modules)
        base_shard, adapter_shard = math.ceil(p / world) * b, math.ceil(adapter / world) * 4
        layer_adapter = adapter // max(1, arch.num_layers) * 4  # one layer's unsharded adapter gradients
        weights, master = base_shard + adapter_shard + (root + 2 * layer) * b, 0
        gradients, optimizer_bytes = adapter_shard + layer_adapter, adapter_shard * moments
        reduce_scatter = layer_adapter + math.ceil(layer_adapter / world)
        if optimizer_offload:  # CPUOffloadPolicy keeps every shard, the frozen base's too, in host memory
            host = base_shard + adapter_shard * (2 + moments)
            weights, gradients, optimizer_bytes = (root + 2 * layer) * b, layer_adapter, 0
    elif world == 1:
        weights, gradients = p * b, p * b
        master = p * 4 * 2 if b < 4 else 0
        optimizer_bytes = p * 4 * moments
    else:
        shard = math.ceil(p / world)
        weights = (root + 2 * layer) * b
        group = max(root, layer)
        reduce_scatter = group * 4 + math.ceil(group / world) * 4
        master, sharded_gradients, optimizer_bytes = shard * 4, shard * 4, shard * 4 * moments
        if optimizer_offload:
            host = master + sharded_gradients + optimizer_bytes
            master, sharded_gradients, optimizer_bytes = 0, 0, 0
        gradients = sharded_gradients + (root + layer) * b
    tokens, layer_acts, head_acts = _activations(
        arch, b, rows=math.ceil(train_batch_size / world), length=max_episode_tokens,
        budget=max_tokens_per_micro_batch, checkpointing=gradient_checkpointing, chunk=logprob_chunk_size,
    )
    backward = tokens * layer_backward_values_per_token(arch) * b
    packed = flash_attention if pack_sequences is None else bool(pack_sequences)
    mask = 0 if flash_attention else _mask_bytes(tokens, max_episode_tokens, packed=packed, b=b)
    return LearnerMemory(
        weights=weights,
        gradients=gradients,
        master=master,
        optimizer=optimizer_bytes,
        activations=layer_acts + backward + mask + head_acts,
        tokens=tokens,
        layer_activations=layer_acts,
        head_activations=head_acts,
        host=host,
        sharded=world > 1,
        backward_activations=backward,
        mask=mask,
        reduce_scatter=reduce_scatter,
        # LoRA: the adapter's float32 tensors, at most all of them (the lora route sends nothing else)
        push=adapter * 4 if lora_rank is not None else push_bytes(
            arch, b, largest_layer=layer, route=weight_sync, bucket_bytes=bucket_bytes),
        process=int(process_bytes),
    )


@dataclass(frozen=True)
class CheckpointMemory:
    """Host bytes a checkpoint save adds, per learner rank, and which save path it takes."""

    layout: str
    """``"dcp"`` (W >= 2: every rank writes its shard, nothing gathered) or ``"single_file"`` (W <= 1)."""
    per_rank: int
    """What every rank adds during the save (rank 0 included)."""
    export: int
    """What rank 0 adds on top for the Hugging Face export of the policy."""

    @property
    def rank0(self) -> int:
        return self.per_rank + self.export


def checkpoint_memory(arch: Architecture, *, dtype: str, optimizer: str, num_learners: int,
                      export_policy: bool = True, lora_rank: int | None = None,
                      lora_target_modules: str = "all-linear") -> CheckpointMemory:
    """The checkpoint formula of the module docstring (``num_learners`` 0: one learner in the driver).

    ``lora_rank``: the state is the float32 adapter and its optimizer moments, gathered to learner 0 and
    written as one file however many learners there are; the export is the adapter (PEFT's folder).
    """
    p = arch.num_parameters()
    b = DTYPE_BYTES[dtype]
    world = max(1, num_learners)
    moments = 2 if optimizer == "adamw" else 0
    if lora_rank is not None:
        adapter = adapter_parameters(arch, int(lora_rank), lora_target_modules)
        return CheckpointMemory("single_file", adapter * (4 + 4 * moments), adapter * 4 if export_policy else 0)
    if world == 1:
        export = p * b if export_policy else 0
        return CheckpointMemory("single_file", p * (4 + 4 * moments) + (p * b if b < 4 else 0), export)
    root = arch.vocab_size * arch.hidden_size * (1 if arch.tie_word_embeddings else 2) + arch.hidden_size
    layer = (p - root) // max(1, arch.num_layers)
    bucket = max(EXPORT_BUCKET_BYTES, layer * b, arch.vocab_size * arch.hidden_size * b)
    return CheckpointMemory("dcp", math.ceil(p / world) * (4 + 4 * moments), 2 * bucket if export_policy else 0)


def layer_backward_values_per_token(arch: Architecture) -> int:
    """g of the module docstring: the gradient values one layer's backward pass holds per token."""
    q = arch.num_attention_heads * arch.head_dim
    kv = arch.num_key_value_heads * arch.head_dim
    if arch.is_moe:
        k = arch.num_experts_per_token
        mlp = 3 * k * arch.intermediate_size + k * arch.hidden_size + arch.num_experts
    else:
        mlp = 3 * arch.intermediate_size
    return 2 * arch.hidden_size + max(mlp, 2 * q + 2 * kv)


def _mask_bytes(tokens: int, length: int, *, packed: bool, b: int) -> int:
    """The 4-D masks of one pass of ``tokens`` tokens: one row when packed, else rows of ``length``."""
    rows, width = (1, tokens) if packed else (max(1, tokens // max(1, length)), length)
    return rows * width * width * (1 + b)


def push_bytes(arch: Architecture, b: int, *, largest_layer: int, route: str, bucket_bytes: int) -> int:
    """``push`` of the module docstring: one gathered bucket, plus vLLM's packed buffers on push routes."""
    largest_tensor = max(arch.vocab_size * arch.hidden_size, _largest_layer_tensor(arch)) * b
    if route == "shm":
        return largest_tensor  # one full tensor at a time on the device; the bucket goes to RAM
    bucket = max(int(bucket_bytes), largest_layer * b)
    if route == "nccl":
        return bucket + 2 * (VLLM_PACKED_BUFFER_BYTES + largest_tensor)
    if route == "ipc":
        return bucket + max(VLLM_PACKED_BUFFER_BYTES, largest_tensor)
    raise ValueError(f"weight_sync: expected 'shm', 'nccl' or 'ipc', got {route!r}.")


def _largest_layer_tensor(arch: Architecture) -> int:
    """Elements of a decoder layer's largest tensor (an MLP projection, or a fused expert tensor)."""
    if arch.is_moe:  # checkpoint names: one expert's projection; model names: E of them (sent split)
        return arch.hidden_size * arch.intermediate_size
    q = arch.num_attention_heads * arch.head_dim
    return max(arch.hidden_size * arch.intermediate_size, arch.hidden_size * q)


def layer_values_per_token(arch: Architecture) -> int:
    """a of the module docstring: values one decoder layer saves per token for its backward pass."""
    q = arch.num_attention_heads * arch.head_dim
    kv = arch.num_key_value_heads * arch.head_dim
    if not arch.is_moe:
        return 4 * arch.hidden_size + 3 * q + 2 * kv + 4 * arch.intermediate_size
    k = arch.num_experts_per_token
    moe = 4 * k * arch.intermediate_size + 2 * k * arch.hidden_size + arch.num_experts
    return 4 * arch.hidden_size + 3 * q + 2 * kv + moe


def _activations(
    arch: Architecture, b: int, *, rows: int, length: int, budget: int | None, checkpointing: bool, chunk: int
) -> tuple[int, int, int]:
    """(tokens M of the largest pass, the layers' bytes, the head's bytes) of the module docstring."""
    tokens = rows * length if budget is None else min(rows * length, max(budget, length))
    a = layer_values_per_token(arch)
    h, v = arch.hidden_size, arch.vocab_size
    if checkpointing:
        layers = tokens * arch.num_layers * h * b + tokens * a * b
    else:
        layers = tokens * arch.num_layers * a * b
    head = tokens * h * (2 * b + 4) + 3 * min(chunk, tokens) * v * 4 + v * h * 4 + (v * h * b if b < 4 else 0)
    return tokens, layers, head


def env_runner_memory(
    arch: Architecture,
    *,
    engine_dtype: str,
    episodes_in_flight: int,
    max_episode_tokens: int,
    cpu_vllm: bool = False,
    kv_cache_memory_bytes: int | None = None,
    cpu_engine: str | None = None,
    kv_cache_source: str = "kv_cache_memory_bytes",
) -> EnvRunnerMemory:
    """The env-runner formula of the module docstring.

    ``cpu_vllm``: the engine is vLLM's CPU build, which reserves ``kv_cache_budget`` bytes (or
    ``kv_cache_memory_bytes`` when given, on either platform); raises its ``ValueError`` when one
    full-context sequence cannot fit. ``cpu_engine``: the engine (``torch`` or ``vllm``) of a runner
    on the CPU, whose processes count (``runner_process_bytes``); None on a GPU. ``kv_cache_source``: what
    set ``kv_cache_memory_bytes``, as an error names it.
    """
    e = DTYPE_BYTES[engine_dtype]
    per_token = kv_bytes_per_token(
        num_layers=arch.num_layers,
        num_kv_heads=arch.num_key_value_heads,
        head_dim=arch.head_dim,
        element_bytes=e,
    )
    reserved = kv_cache_memory_bytes
    if reserved is not None:
        check_kv_cache_bytes(
            int(reserved),
            context_tokens=max_episode_tokens,
            bytes_per_token=per_token,
            block_size=CPU_BLOCK_SIZE if cpu_vllm else GPU_BLOCK_SIZE,
            source=kv_cache_source,
        )
    elif cpu_vllm:
        reserved = kv_cache_budget(
            num_seqs=episodes_in_flight,
            context_tokens=max_episode_tokens,
            bytes_per_token=per_token,
            block_size=CPU_BLOCK_SIZE,
        ).reserved_bytes
    weights = arch.num_parameters() * e
    return EnvRunnerMemory(
        weights=weights,
        kv_cache=episodes_in_flight * max_episode_tokens * per_token,
        kv_bytes_per_token=per_token,
        kv_cache_reserved=reserved,
        process=0 if cpu_engine is None else runner_process_bytes(cpu_engine, weights=weights),
    )


def runner_process_bytes(engine: str, *, weights: int) -> int:
    """``process`` of the env-runner formula: a CPU runner's processes besides its engine's tensors."""
    if engine == "torch":  # one process; the update's buckets mapped from the object store, the model's file
        return PROCESS_BYTES + 2 * weights
    # vLLM: the runner's process and its engine core, each with vLLM imported; the runner passes every
    # update on (3 copies), the engine core holds two besides the weights counted by the caller
    # (benchmarks/results/process_memory.json, runs.vllm: 2660 + 2937 MiB measured, 4542 estimated)
    return 2 * VLLM_PROCESS_BYTES + 5 * weights


def format_bytes(n: float) -> str:
    """'1.50 GiB', '340.0 MiB', '12.0 KiB'."""
    for unit, size in (("TiB", 1024**4), ("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}" if unit in ("TiB", "GiB") else f"{n / size:.1f} {unit}"
    return f"{int(n)} B"
