"""One command that checks flashrl on a GPU machine: learner update, log-prob kernel, torch engine, FSDP2.

Written for a machine with torch and transformers but no network, no vLLM and no Ray (the GPU machine
this project is lent: one H200, Python 3.12, torch 2.11; ``docs/engines.md``, "Checking a GPU
machine"). Nothing is downloaded: the model has random weights built from a config and the tokenizer
is built here with the ``tokenizers`` library. Every phase writes its figures, or why it was skipped,
into one JSON::

    python scripts/gpu_check.py                          # every phase; sized for 2-3 minutes on one H200
    python scripts/gpu_check.py --phase learner fsdp     # some phases
    python scripts/gpu_check.py --small                  # the same code on CPU with a tiny model (tests)

The phases, in order (each frees its GPU memory before the next):

``matmul``
    An 8192^3 bfloat16 matrix product: the measured ceiling the learner's MFU is also reported against.
``learner``
    One ``Learner`` update (``flashrl/learners/learner.py``, one full replica: ``LocalPolicy``) of a
    Qwen2.5-1.5B-shaped model (``flashrl/plan/architectures.py``, Qwen/Qwen2.5-Math-1.5B: random
    bfloat16 weights, float32 master weights and AdamW) on ``--batch-size`` x ``--length`` tokens
    (default 128 x 4,096) in micro-batches of ``--max-tokens-per-micro-batch`` with gradient
    checkpointing, after a warm-up update on ``--warmup-batch-size`` trajectories. Reports the
    update's seconds, tokens/s, model FLOPs utilisation, and its peak memory against the plan's
    formula (``flashrl.plan.memory.learner_memory``).
``logprobs``
    Chunked (``flashrl/ops/logprobs.py``) vs naive log-prob + entropy + backward at ``--logprob-tokens``
    (default 8k and 16k) tokens, V = 151,936, H = 1,536, bfloat16 inputs, as
    ``benchmarks/logprob_memory.py`` does: peak memory and time of both, their ratios, and the largest
    difference of their log-probs and hidden-state gradients.
``engine``
    The torch engine (``flashrl/engines/torch_engine.py``) sampling on CUDA in bfloat16, then the
    learner's recomputation of the same tokens (``flashrl.engines.agreement.measure_agreement``, a
    model loaded as ``LocalPolicy`` loads it): the log-prob differences and the Bernoulli-KL drift
    that the trust region gates on.
``fsdp``
    The learner as FSDP2 on a one-rank NCCL group (``flashrl/learners/fsdp.py``: per-layer
    ``fully_shard``, bfloat16 mixed precision with float32 reduction, the checkpoint wrapper;
    ``flashrl/learners/distributed.py``), one update on the warm-up batch, its loss and gradient norm
    compared with the ``learner`` phase's warm-up update on the same batch and weights.
``packed``
    The learner's packed path (``LearnerSpec.pack_sequences=True``: every micro-batch one packed
    sequence with position ids that restart per trajectory, ``flashrl.models.packing``) against its
    padded path (sdpa), on one ragged batch (``--batch-size`` / 4 trajectories of ``--length`` / 8 to
    ``--length`` tokens), packed twice: ``packed`` with sdpa's materialised block-diagonal mask
    (``pack_attention="sdpa_mask"``) and ``packed_flex`` with FlexAttention's document mask
    (``pack_attention="flex"``; CUDA only, FlexAttention has no backward on CPU: recorded as skipped).
    Each against padded: the two updates' loss and gradient norm on the same weights and batch, then
    each path's time, real tokens/s and peak memory on a second such batch, and
    ``speedup_packed_flex_over_padded`` (the goal: at least 1.3).
    First, what ``flashrl.models.packing_tolerance`` rests on: for the model in bfloat16 and float32,
    how far two packed sequences' log-probs are from each scored alone (rounding, where the mask
    works), and how far a leak would move them (the two scored as one causal sequence).
``push``
    The run's own weight-sync route end to end through Ray and vLLM: a FlashREINFORCE run
    (``FlashReinforceConfig().build_algo()``) with one learner actor and one EnvRunner actor,
    ``engine_options={"weight_sync": --push-route}``, ``--push-iterations`` synchronous iterations,
    checking that every update was pushed and sampled from (policy lag 0). Needs Ray, vLLM (the torch
    engine with ``--small``), gymnasium and math-verify: skipped, with the reason, where they are not
    importable.

Exit status 0 when no phase failed (a skipped phase is not a failure). ``--small`` runs every phase
on CPU with a tiny Qwen2, float32 and gloo in seconds (``tests/scripts/test_gpu_check.py`` runs it
with vLLM, Ray, gymnasium and math-verify made unimportable and no package index).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import math
import os
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

# The flashrl modules the phases import are named inside each phase (and only there), so a phase
# whose modules need what this machine lacks fails alone. The weight-sync modules that `push` uses:
WEIGHT_SYNC_MODULES = ("flashrl.weight_sync.route", "flashrl.weight_sync.push", "flashrl.weight_sync.nccl",
                       "flashrl.weight_sync.ipc", "flashrl.learners.weight_gather")

PHASES = ("matmul", "learner", "logprobs", "engine", "fsdp", "packed", "push")

H200_BF16_DENSE_FLOPS = 989e12
"""The vendor's datasheet dense bfloat16 rate of an H200 SXM (that of the H100 SXM); the ``matmul``
phase measures the reachable one (about 790e12 on these machines)."""

GIB = 2**30


# ---------------------------------------------------------------------------------------------- options
@dataclass(frozen=True)
class Options:
    small: bool
    output: Path
    phases: tuple[str, ...]
    batch_size: int
    length: int
    max_tokens_per_micro_batch: int
    warmup_batch_size: int
    logprob_tokens: tuple[int, ...]
    logprob_vocab: int
    logprob_hidden: int
    logprob_chunk_size: int
    engine_prompts: int
    prompt_tokens: int
    new_tokens: int
    push_engine: str
    push_route: str
    push_iterations: int
    gpu_memory_utilization: float
    matmul_size: int

    @property
    def device(self) -> str:
        return "cpu" if self.small else "cuda"

    @property
    def dtype(self) -> str:
        return "float32" if self.small else "bfloat16"

    # the push phase's names (kept from its first version)
    @property
    def engine(self) -> str:
        return self.push_engine


PUSH_LAYOUTS = {
    "ipc": "the learner and the engine share one GPU (0.5 + 0.5)",
    "nccl": "the learner and the engine take a GPU each (1 + 1; NCCL cannot put two ranks on one device)",
    "shm": "the learner and the engine take a GPU each (1 + 1; asked of Ray as whole GPUs)",
}
"""How the push phase places its learner and its engine per route (``push_config``'s GPU shares)."""


def push_gpus(route: str, *, small: bool) -> int:
    """GPUs the push phase asks Ray for: none with ``--small``, one for ``ipc``, two for the others."""
    if small:
        return 0
    return 1 if route == "ipc" else 2


def parse_args(argv: list[str] | None = None) -> Options:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--small", "--dry-run", dest="small", action="store_true",
                   help="tiny model on CPU, float32, gloo: the same code path in seconds (tests)")
    p.add_argument("--phase", nargs="+", choices=[*PHASES, "all"], default=["all"],
                   help="phases to run (default all); the others are recorded as not selected")
    p.add_argument("--output", type=Path, default=Path("benchmarks/results/gpu_check.json"))
    p.add_argument("--batch-size", type=int, default=None, help="learner trajectories (128; 4 with --small)")
    p.add_argument("--length", type=int, default=None, help="tokens per trajectory (4096; 64 with --small)")
    p.add_argument("--max-tokens-per-micro-batch", type=int, default=None, help="16384 (128 with --small)")
    p.add_argument("--warmup-batch-size", type=int, default=None,
                   help="trajectories of the warm-up update, also the fsdp phase's batch (16; 2 with --small)")
    p.add_argument("--logprob-tokens", type=int, nargs="+", default=None, help="8192 16384 (256 512 with --small)")
    p.add_argument("--engine-prompts", type=int, default=None, help="prompts sampled (8; 2 with --small)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens per completion (64; 8 with --small)")
    p.add_argument("--push-engine", choices=["vllm", "torch"], default=None, help="vllm (torch with --small)")
    p.add_argument("--push-route", choices=["ipc", "nccl", "shm"], default=None,
                   help="weight_sync of the push phase (ipc on one GPU, nccl on several, shm with --small)")
    p.add_argument("--push-iterations", type=int, default=3, help="iterations of the push phase (>= 2)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="vLLM's share of the GPU (push)")
    a = p.parse_args(argv)
    small = a.small
    gpus = torch.cuda.device_count()
    if not small and gpus == 0:
        p.error("no CUDA GPU is visible; run with --small to check the code path on CPU")
    route = a.push_route or ("shm" if small else ("ipc" if gpus == 1 else "nccl"))
    if small and route != "shm":
        p.error(f"--push-route {route} needs a GPU (vLLM's transfer engines live in its GPU worker); use shm")
    needed = push_gpus(route, small=small)
    if gpus < needed:  # Ray would wait for the GPUs forever: refuse before it starts
        p.error(f"--push-route {route} needs {needed} GPUs, this machine has {gpus}: {PUSH_LAYOUTS[route]}; "
                "use ipc (the learner and the engine share one GPU)")
    if a.push_iterations < 2:
        p.error(f"--push-iterations: expected >= 2 (a batch sampled after a push), got {a.push_iterations}")
    phases = PHASES if "all" in a.phase else tuple(x for x in PHASES if x in a.phase)
    opts = Options(
        small=small,
        output=a.output,
        phases=phases,
        batch_size=a.batch_size or (4 if small else 128),
        length=a.length or (64 if small else 4096),
        max_tokens_per_micro_batch=a.max_tokens_per_micro_batch or (128 if small else 16384),
        warmup_batch_size=a.warmup_batch_size or (2 if small else 16),
        logprob_tokens=tuple(a.logprob_tokens or ((256, 512) if small else (8192, 16384))),
        logprob_vocab=4096 if small else 151_936,
        logprob_hidden=128 if small else 1536,
        logprob_chunk_size=1024,  # LearnerSpec.logprob_chunk_size's default: what the learner runs
        engine_prompts=a.engine_prompts or (2 if small else 8),
        prompt_tokens=8 if small else 64,
        new_tokens=a.new_tokens or (8 if small else 64),
        push_engine=a.push_engine or ("torch" if small else "vllm"),
        push_route=route,
        push_iterations=a.push_iterations,
        gpu_memory_utilization=a.gpu_memory_utilization,
        matmul_size=512 if small else 8192,
    )
    if opts.max_tokens_per_micro_batch < opts.length:
        p.error(f"--max-tokens-per-micro-batch {opts.max_tokens_per_micro_batch} < --length {opts.length}: "
                "a trajectory is never split, so every pass would exceed the budget; raise it")
    return opts


# ---------------------------------------------------------------------------------------------- model
def architecture(opts: Options) -> Any:
    """The learner's shape: Qwen2.5-1.5B's (``flashrl/plan/architectures.py``), or a tiny Qwen2."""
    from flashrl.plan.architectures import ARCHITECTURES, Architecture

    if opts.small:  # head_dim 64, biases on q/k/v as Qwen2; exactly the tokenizer's vocabulary, so that the
        # push phase's env can decode every sampled id (the full model's padding rows are never decoded)
        vocab = len(build_tokenizer())
        return Architecture("tiny-qwen2", "qwen2", 2, 128, 256, 2, 1, 64, vocab, True, 512, attention_bias=True)
    return ARCHITECTURES["Qwen/Qwen2.5-Math-1.5B"]


TOKENIZER_WORDS = (
    [str(i) for i in range(200)]
    + list("+-*/=()?.,:;!'\"")
    + ["what", "is", "the", "sum", "of", "and", "answer", "question", "think", "final", "a", "an", "it", "in",
       "on", "to", "system", "user", "assistant"]
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>", "<unk>")
CHAT_TEMPLATE = (  # ChatML, as Qwen2's: the push phase's env renders its prompts with it
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer() -> Any:
    """A word-level tokenizer over a fixed word list (no file, no download): specials, then words.

    The model's vocabulary is larger (Qwen2's 151,936 rows); the ids above the tokenizer's are sampled
    like any other, and nothing here decodes them.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate((*SPECIAL_TOKENS, *TOKENIZER_WORDS))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|endoftext|>", pad_token="<pad>", unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"], chat_template=CHAT_TEMPLATE,
    )


def build_model(opts: Options, arch: Any, out_dir: str) -> str:
    """Random weights of ``arch`` in the run's dtype, saved with the built tokenizer; returns the folder."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer()
    if arch.vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size {arch.vocab_size} < the tokenizer's {len(tokenizer)} tokens")
    config = Qwen2Config(
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_key_value_heads,
        vocab_size=arch.vocab_size,
        tie_word_embeddings=arch.tie_word_embeddings,
        max_position_embeddings=arch.max_position_embeddings,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype=opts.dtype,
    )
    torch.manual_seed(0)
    with torch.device(opts.device):
        model = Qwen2ForCausalLM(config).to(getattr(torch, opts.dtype))
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    del model
    _free(opts)
    return out_dir


def make_batch(opts: Options, vocab: int, seed: int, batch_size: int | None = None) -> Any:
    """``batch_size`` trajectories of exactly ``length`` tokens, a prompt of ``length // 4`` (<= 64) outside the loss."""
    from flashrl.learners.batch import TrainBatch

    gen = torch.Generator().manual_seed(seed)
    b, t = batch_size or opts.batch_size, opts.length
    prompt = min(64, t // 4)
    ids = torch.randint(0, vocab, (b, t), generator=gen)  # [B, T]
    loss_mask = torch.zeros(b, t, dtype=torch.bool)  # [B, T]
    loss_mask[:, prompt:] = True
    behavior = torch.full((b, t), -math.log(vocab)).masked_fill(~loss_mask, 0.0)  # [B, T] ~ a random model's
    return TrainBatch(
        token_ids=ids,
        attention_mask=torch.ones(b, t, dtype=torch.bool),
        loss_mask=loss_mask,
        behavior_logprobs=behavior,
        rewards=(torch.arange(b) % 2).float(),
        policy_versions=torch.zeros(b, dtype=torch.long),
        prompt_ids=[f"p{i}" for i in range(b)],
    )


def make_ragged_batch(opts: Options, vocab: int, seed: int) -> Any:
    """``max(4, batch_size // 4)`` right-padded trajectories of ``length // 8`` to ``length`` tokens (evenly
    spread, shuffled), a prompt of ``length // 16`` (<= 64) outside the loss: what packing is for."""
    from flashrl.learners.batch import TrainBatch

    gen = torch.Generator().manual_seed(seed)
    b, t = max(4, opts.batch_size // 4), opts.length
    lengths = torch.linspace(t // 8, t, b).round().long()[torch.randperm(b, generator=gen)]  # [B]
    positions = torch.arange(t).unsqueeze(0)  # [1, T]
    attention_mask = positions < lengths.unsqueeze(1)  # [B, T]
    loss_mask = attention_mask & (positions >= min(64, t // 16))  # [B, T]
    ids = torch.randint(0, vocab, (b, t), generator=gen).masked_fill(~attention_mask, 0)  # [B, T]
    behavior = torch.full((b, t), -math.log(vocab)).masked_fill(~loss_mask, 0.0)  # [B, T]
    return TrainBatch(
        token_ids=ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        behavior_logprobs=behavior,
        rewards=(torch.arange(b) % 2).float(),
        policy_versions=torch.zeros(b, dtype=torch.long),
        prompt_ids=[f"p{i}" for i in range(b)],
    )


def train_flops_per_token(arch: Any, length: int) -> float:
    """Model FLOPs of one trained token (forward + backward = 3 x forward; recomputation not counted).

    Forward: 2 per weight of every matrix product (the decoder's and the output layer's, an
    embedding lookup is none) plus causal attention's QK^T and AV, 2 x 2 x q x (T + 1) / 2 per layer
    on average over the positions of a T-token sequence.
    """
    embedding = arch.vocab_size * arch.hidden_size
    # tied: the embedding, counted once, is the head's product; untied: the lookup table is no product
    matmul_weights = arch.num_parameters() - (0 if arch.tie_word_embeddings else embedding)
    q = arch.num_attention_heads * arch.head_dim
    attention = arch.num_layers * 2 * q * (length + 1)
    return 3.0 * (2.0 * matmul_weights + attention)


# ---------------------------------------------------------------------------------------------- memory
def _free(opts: Options) -> None:
    gc.collect()
    if opts.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _peak_reset(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the peak resident set size (VmHWM)


def _peak(device: str) -> int:
    if device == "cuda":
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated())
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------- phases
@dataclass
class Context:
    """What the phases share: the model folder and shape, and figures one phase compares with another."""

    opts: Options
    model: str
    arch: Any
    warmup: dict[str, float] = field(default_factory=dict)
    """The learner phase's warm-up update (loss, grad_norm): the fsdp phase's reference."""


class PhaseCheckFailed(RuntimeError):
    """A phase ran but its check failed; ``measured`` (what it measured) is kept in the phase's record."""

    def __init__(self, message: str, measured: dict[str, Any]) -> None:
        super().__init__(message)
        self.measured = measured


def phase_matmul(ctx: Context) -> dict[str, Any]:
    """Mean rate of ten n^3 products after three warm-ups (as the machine's own ceiling was measured)."""
    opts = ctx.opts
    n = opts.matmul_size
    gen = torch.Generator(device=opts.device).manual_seed(0)
    dtype = getattr(torch, opts.dtype)
    a = torch.randn(n, n, device=opts.device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=opts.device, dtype=dtype, generator=gen)
    for _ in range(3):
        a @ b
    _sync(opts.device)
    start = time.perf_counter()
    for _ in range(10):
        c = a @ b
    _sync(opts.device)
    seconds = (time.perf_counter() - start) / 10
    if not bool(torch.isfinite(c).all()):
        raise RuntimeError("the matrix product has non-finite entries")
    return {"n": n, "dtype": opts.dtype, "seconds": seconds, "flops_per_s": 2.0 * n**3 / seconds}


def _learner_spec(ctx: Context, batch_budget: int) -> Any:
    from flashrl.algorithms.flash_reinforce.learner_loss import FlashReinforceLossSpec
    from flashrl.learners.spec import LearnerSpec

    return LearnerSpec(
        model=ctx.model,
        dtype=ctx.opts.dtype,
        optimizer="adamw",
        lr=1e-6,
        betas=(0.9, 0.95),
        weight_decay=0.1,
        device=ctx.opts.device,
        gradient_checkpointing=True,
        max_tokens_per_micro_batch=batch_budget,
        logprob_chunk_size=ctx.opts.logprob_chunk_size,
        loss=FlashReinforceLossSpec(delta=0.003),
    )


def _timed_update(learner: Any, batch: Any, device: str) -> dict[str, Any]:
    _peak_reset(device)
    start = time.perf_counter()
    metrics = learner.update(batch)
    _sync(device)
    seconds = time.perf_counter() - start
    out = {
        "seconds": seconds,
        "peak_bytes": _peak(device),
        "applied": metrics["applied"],
        "num_micro_batches": metrics.get("num_micro_batches"),
        "loss": metrics.get("loss"),
        "grad_norm": metrics.get("grad_norm"),
        "tokens": batch.batch_size * int(batch.token_ids.shape[1]),
    }
    if out["applied"] != 1.0 or not all(math.isfinite(out[k]) for k in ("loss", "grad_norm")):
        raise RuntimeError(f"the update was not applied with finite loss and gradient norm: {metrics}")
    return out


def phase_learner(ctx: Context, matmul_flops_per_s: float | None) -> dict[str, Any]:
    from flashrl.learners.learner import Learner
    from flashrl.plan.memory import learner_memory

    opts, arch = ctx.opts, ctx.arch
    spec = _learner_spec(ctx, opts.max_tokens_per_micro_batch)
    t0 = time.perf_counter()
    learner = Learner(spec)
    build_s = time.perf_counter() - t0
    vocab = int(learner.model.config.vocab_size)
    # Warm-up (kernels, AdamW's state): the fsdp phase repeats this very update (batch seed 1).
    warm = _timed_update(learner, make_batch(opts, vocab, seed=1, batch_size=opts.warmup_batch_size), opts.device)
    ctx.warmup = {"loss": warm["loss"], "grad_norm": warm["grad_norm"]}
    update = _timed_update(learner, make_batch(opts, vocab, seed=2), opts.device)
    if update["num_micro_batches"] < 2:
        raise RuntimeError(f"expected several micro-batches, got {update['num_micro_batches']}")
    plan = learner_memory(
        arch, dtype=opts.dtype, optimizer="adamw", train_batch_size=opts.batch_size, num_learners=1,
        max_episode_tokens=opts.length, gradient_checkpointing=True,
        logprob_chunk_size=opts.logprob_chunk_size, max_tokens_per_micro_batch=opts.max_tokens_per_micro_batch,
    )
    model_flops = train_flops_per_token(arch, opts.length) * update["tokens"]
    achieved = model_flops / update["seconds"]
    out: dict[str, Any] = {
        "build_s": build_s,
        "packed": learner.pack_sequences,
        "attention": str(getattr(learner.model.config, "_attn_implementation", "")),
        "warmup_update": warm,
        "update": update,
        "tokens_per_s": update["tokens"] / update["seconds"],
        "model_flops": model_flops,
        "model_flops_per_s": achieved,
        "plan_bytes": {"weights": plan.weights, "gradients": plan.gradients, "master": plan.master,
                       "optimizer": plan.optimizer, "activations": plan.activations, "total": plan.total},
        # on CPU the peak is the process's resident set (libraries included): no comparison
        "peak_over_plan": update["peak_bytes"] / plan.total if opts.device == "cuda" else None,
        "logprob_kernel": logprob_kernel(opts.device),
    }
    if opts.device == "cuda":
        out["mfu_vs_datasheet"] = achieved / H200_BF16_DENSE_FLOPS
        if matmul_flops_per_s:
            out["mfu_vs_measured_matmul"] = achieved / matmul_flops_per_s
    del learner
    return out


def logprob_kernel(device: str) -> dict[str, Any]:
    """Which chunk kernel `flashrl.ops.logprobs` ran: compiled on CUDA unless turned off or failed."""
    from flashrl.ops import logprobs

    compiled = device == "cuda" and logprobs.COMPILE_ON_CUDA and not logprobs._compile_error
    return {"kernel": "torch.compile" if compiled else "eager",
            "compile_error": logprobs._compile_error[0] if logprobs._compile_error else None}


def _logprob_once(method: str, n: int, opts: Options, dt: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    from flashrl.ops.logprobs import chunked_token_logprobs

    torch.manual_seed(0)
    dev = opts.device
    h = torch.randn(n, opts.logprob_hidden, device=dev, dtype=dt, requires_grad=True)  # [N, H]
    w = torch.randn(opts.logprob_vocab, opts.logprob_hidden, device=dev, dtype=dt)  # [V, H]
    w = w.mul_(opts.logprob_hidden**-0.5).requires_grad_()
    targets = torch.randint(0, opts.logprob_vocab, (n,), device=dev)  # [N]
    _free(opts)
    _peak_reset(dev)
    base = torch.cuda.memory_allocated() if dev == "cuda" else _peak(dev)
    start = time.perf_counter()
    if method == "naive":
        logp = torch.log_softmax((h @ w.T).float(), -1)  # [N, V] float32, kept for backward
        lp = logp.gather(-1, targets[:, None]).squeeze(-1)  # [N]
        ent = -(logp.exp() * logp).sum(-1)  # [N]
    else:
        out = chunked_token_logprobs(h, w, targets, chunk_size=opts.logprob_chunk_size)
        lp, ent = out.logprobs, out.entropy
    (lp.sum() + 0.01 * ent.sum()).backward()
    _sync(dev)
    seconds = time.perf_counter() - start
    peak = _peak(dev) - base
    return {"peak_bytes": int(peak), "seconds": seconds, "logprobs": lp.detach().float().cpu(),
            "grad_hidden": h.grad.float().cpu(), "bound": bf16_logprob_bound(h.detach(), w.detach())}


LOGPROB_TOLERANCE_FP32 = 1e-3
"""Max |d logprob| between the chunked and the naive path in float32: the same products in another
order and chunking (float32 rounding is about 1e-7 relative; 1e-3 leaves room for the logsumexp of
151,936 terms, and a wrong row or target moves a log-prob by far more)."""
GRAD_TOLERANCE_FP32 = 1e-3


def bf16_logprob_bound(h: torch.Tensor, w: torch.Tensor) -> float:
    """A bound on |d logprob| when two bf16 matmul algorithms round the logits differently.

    Each logit z = h . w is rounded to bf16 (8 significant bits): one rounding moves it by at most
    half an ulp, 2^(floor(log2 |z|) - 8), so two paths differ by at most one ulp of the largest |z|; a
    log-prob (the target's logit minus the logsumexp) then moves by at most two of those. |z| is
    bounded by max ||h_i|| * max ||w_j|| (Cauchy-Schwarz), so the bound never under-states.
    """
    z_max = float(h.float().norm(dim=-1).max() * w.float().norm(dim=-1).max())
    return 2.0 * 2.0 ** (math.floor(math.log2(max(z_max, 1e-30))) - 7)


def _compare(n: int, opts: Options, dt: torch.dtype) -> dict[str, Any]:
    _logprob_once("chunked", min(n, 1024), opts, dt)  # warm-up of both paths' kernels
    _logprob_once("naive", min(n, 1024), opts, dt)
    naive = _logprob_once("naive", n, opts, dt)
    chunked = _logprob_once("chunked", n, opts, dt)
    lp_diff = float((naive.pop("logprobs") - chunked.pop("logprobs")).abs().max())
    g_naive, g_chunked = naive.pop("grad_hidden"), chunked.pop("grad_hidden")
    grad_rel = float((g_naive - g_chunked).norm() / g_naive.norm().clamp_min(1e-30))
    chunked.pop("bound")
    return {"naive": naive, "chunked": chunked, "max_abs_logprob_diff": lp_diff, "grad_hidden_relative_diff": grad_rel,
            "bound": naive.pop("bound")}


def phase_logprobs(ctx: Context) -> dict[str, Any]:
    """Chunked vs naive log-probs: agreement gated in float32; memory and time in bfloat16 (what the learner
    runs), with the bf16 disagreement recorded next to its rounding bound (cuBLAS may pick another
    algorithm for 1,024-row and 16,384-row products, so bf16 results need not agree to 1e-3)."""
    opts = ctx.opts
    rows = []
    for n in opts.logprob_tokens:
        exact = _compare(n, opts, torch.float32)
        if not (exact["max_abs_logprob_diff"] < LOGPROB_TOLERANCE_FP32
                and exact["grad_hidden_relative_diff"] < GRAD_TOLERANCE_FP32):
            raise RuntimeError(
                f"at {n} tokens chunked and naive disagree in float32: max |d logprob| "
                f"{exact['max_abs_logprob_diff']:.3g} (expected < {LOGPROB_TOLERANCE_FP32:g}), relative grad "
                f"difference {exact['grad_hidden_relative_diff']:.3g} (expected < {GRAD_TOLERANCE_FP32:g})")
        bf16 = _compare(n, opts, torch.bfloat16)
        naive, chunked = bf16["naive"], bf16["chunked"]
        rows.append({
            "tokens": n, "naive": naive, "chunked": chunked,
            # CPU: peaks of the resident set, too coarse for the chunked path's few MiB: no ratio
            "memory_ratio_naive_over_chunked": (naive["peak_bytes"] / max(chunked["peak_bytes"], 1)
                                                if opts.device == "cuda" else None),
            "time_ratio_chunked_over_naive": chunked["seconds"] / naive["seconds"],
            "float32_max_abs_logprob_diff": exact["max_abs_logprob_diff"],
            "float32_grad_hidden_relative_diff": exact["grad_hidden_relative_diff"],
            "max_abs_logprob_diff": bf16["max_abs_logprob_diff"],
            "grad_hidden_relative_diff": bf16["grad_hidden_relative_diff"],
            "bf16_logprob_rounding_bound": bf16["bound"],
            "bf16_within_rounding_bound": bf16["max_abs_logprob_diff"] <= bf16["bound"],
        })
    return {"vocab": opts.logprob_vocab, "hidden": opts.logprob_hidden, "chunk_size": opts.logprob_chunk_size,
            "dtype": "bfloat16 (memory, time); float32 (the agreement gate)", "rows": rows,
            "logprob_kernel": logprob_kernel(opts.device)}


def phase_engine(ctx: Context) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from flashrl.engines import make_engine
    from flashrl.engines.agreement import measure_agreement
    from flashrl.engines.types import SamplingConfig
    from flashrl.learners.policies import attention_implementation

    opts = ctx.opts
    t0 = time.perf_counter()
    engine = make_engine("torch", ctx.model, seed=0, dtype=opts.dtype, device=opts.device,
                         max_model_len=opts.prompt_tokens + opts.new_tokens, max_batch_size=opts.engine_prompts)
    start_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(0)
    vocab = len(engine.tokenizer)  # prompts are text ids; the sampled ones range over the model's rows
    prompts = torch.randint(0, vocab, (opts.engine_prompts, opts.prompt_tokens), generator=gen).tolist()
    sampling = SamplingConfig(temperature=1.0, max_tokens=opts.new_tokens, seed=0)

    async def sample(engine: Any) -> list[Any]:
        return await asyncio.gather(*(engine.generate(p, replace(sampling, seed=i)) for i, p in enumerate(prompts)))

    try:
        t0 = time.perf_counter()
        completions = asyncio.run(sample(engine))
        _sync(opts.device)
        seconds = time.perf_counter() - t0
        largest_batch = engine.largest_batch
    finally:
        engine.close()
    del engine
    _free(opts)
    tokens = sum(len(c.token_ids) for c in completions)
    logprobs = [lp for c in completions for lp in c.logprobs]
    if tokens == 0 or len(logprobs) != tokens or not all(math.isfinite(x) and x <= 1e-6 for x in logprobs):
        raise RuntimeError(f"expected a finite log-prob <= 0 for each of {tokens} tokens; got {len(logprobs)}")
    dtype = getattr(torch, opts.dtype)
    device = torch.device(opts.device)
    learner_model = AutoModelForCausalLM.from_pretrained(  # as LocalPolicy loads the policy
        ctx.model, dtype=dtype, attn_implementation=attention_implementation(device, dtype)
    ).to(device).eval()
    report = measure_agreement(learner_model, prompts, completions, temperature=1.0)
    del learner_model
    return {
        "start_s": start_s, "seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
        "largest_batch": largest_batch, "mean_logprob": sum(logprobs) / len(logprobs),
        "dtype": opts.dtype, "agreement": dataclasses.asdict(report),
    }


def phase_fsdp(ctx: Context) -> dict[str, Any]:
    """The learner with ``ShardedPolicy`` on one rank (``Learner`` shards only for world_size >= 2)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from flashrl.learners import distributed, fsdp
    from flashrl.learners import learner as learner_module
    from flashrl.learners.policies import ShardedPolicy

    opts = ctx.opts
    if opts.device == "cuda":
        torch.cuda.set_device(0)
    backend = "nccl" if opts.device == "cuda" else "gloo"
    distributed.init_process_group(master_addr="127.0.0.1", master_port=distributed.find_free_port(),
                                   rank=0, world_size=1, backend=backend, timeout_s=300)
    try:
        spec = _learner_spec(ctx, opts.max_tokens_per_micro_batch)

        def one_rank_sharded(spec: Any, device: torch.device) -> ShardedPolicy:
            return ShardedPolicy(spec, device, rank=0)

        local = learner_module.LocalPolicy
        learner_module.LocalPolicy = one_rank_sharded  # the one name Learner builds its policy by
        try:
            t0 = time.perf_counter()
            learner = learner_module.Learner(spec)
            build_s = time.perf_counter() - t0
        finally:
            learner_module.LocalPolicy = local
        model = learner.model
        units = sum(1 for m in model.modules() if isinstance(m, fsdp.FSDPModule))
        wrapped = sum(1 for m in model.modules() if isinstance(m, CheckpointWrapper))
        layers = ctx.arch.num_layers
        if units != layers + 1 or wrapped != layers:
            raise RuntimeError(f"expected {layers} + 1 FSDP units and {layers} checkpoint-wrapped layers; "
                               f"got {units} and {wrapped}")
        master_dtype = str(next(model.parameters()).dtype)
        vocab = int(model.config.vocab_size)
        update = _timed_update(learner, make_batch(opts, vocab, seed=1, batch_size=opts.warmup_batch_size),
                               opts.device)
        out: dict[str, Any] = {"backend": backend, "build_s": build_s, "fsdp_units": units,
                               "checkpoint_wrapped_layers": wrapped, "master_dtype": master_dtype,
                               "update": update, "tokens_per_s": update["tokens"] / update["seconds"]}
        if ctx.warmup:  # the same batch on the same weights as the learner phase's warm-up
            # The loss absolutely, as in the packed phase: with mean-zero advantages it sits near 0.
            loss_diff = abs(update["loss"] - ctx.warmup["loss"])
            grad_diff = abs(update["grad_norm"] - ctx.warmup["grad_norm"]) / max(ctx.warmup["grad_norm"], 1e-12)
            out["vs_local"] = {"local": ctx.warmup, "loss_abs_diff": loss_diff,
                               "grad_norm_relative_diff": grad_diff}
            # bf16: the local learner accumulates micro-batch gradients in bf16, FSDP2 reduces in float32
            tol = 1e-4 if opts.dtype == "float32" else 5e-2
            if not (loss_diff < tol and grad_diff < tol):
                raise PhaseCheckFailed(f"FSDP2 and the local learner disagree on one batch: loss {loss_diff:.3g} "
                                       f"apart, grad norm {grad_diff:.3g} relative (expected < {tol})", out)
        del learner, model
        return out
    finally:
        if torch.distributed.is_initialized():  # a failed start must not hide its error behind this one
            torch.distributed.destroy_process_group()


def packing_probe(model: Any, first_len: int, second_len: int) -> dict[str, float]:
    """Max |log-prob difference| of two packed sequences vs each alone, and of a leak vs alone.

    The leak: the second sequence's tokens predicted with the first before them in one causal row
    (a 2D mask of ones turns transformers' packed-sequence detection off), as a model whose mask code
    ignores packed position ids would score them.
    """
    from flashrl.models import compute_packed_token_logprobs

    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(0)
    vocab = int(model.config.vocab_size)
    first = torch.randint(0, vocab, (first_len,), generator=gen).to(device)  # [n1]
    second = torch.randint(0, vocab, (second_len,), generator=gen).to(device)  # [n2]
    ids = torch.cat([first, second]).unsqueeze(0)  # [1, n1 + n2]
    restart = torch.cat([torch.arange(first_len), torch.arange(second_len)]).unsqueeze(0).to(device)  # [1, n]

    def alone(seq: torch.Tensor) -> torch.Tensor:
        return compute_packed_token_logprobs(model, seq.unsqueeze(0), torch.arange(seq.shape[0], device=device)
                                             .unsqueeze(0), with_entropy=False)[0]  # [1, n_i]

    def next_token(row: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        logits = model(input_ids=row, position_ids=positions, attention_mask=mask).logits.float()  # [1, n, V]
        return torch.log_softmax(logits[:, :-1], -1).gather(-1, row[:, 1:, None])[..., 0]  # [1, n - 1]

    with torch.no_grad():
        packed, _ = compute_packed_token_logprobs(model, ids, restart, with_entropy=False)  # [1, n]
        separate = torch.cat([alone(first), alone(second)], dim=1)  # [1, n]
        leak = next_token(ids, restart, torch.ones_like(ids))[:, first_len:]  # [1, n2 - 1]: second[1:]
        clean = next_token(second.unsqueeze(0), restart[:, first_len:], None)  # [1, n2 - 1]
    return {"packed_vs_alone": float((packed - separate).abs().max()),
            "leak_vs_alone": float((leak - clean).abs().max())}


def phase_packed(ctx: Context) -> dict[str, Any]:
    """Padded, then packed: one update on ragged batch 3 (same weights: must agree), one timed on batch 4."""
    from transformers import AutoModelForCausalLM

    from flashrl.learners.learner import Learner

    opts = ctx.opts
    probe: dict[str, dict[str, float]] = {}
    for dtype in ("bfloat16", "float32"):
        model = AutoModelForCausalLM.from_pretrained(ctx.model, dtype=getattr(torch, dtype),
                                                     attn_implementation="sdpa").to(opts.device).eval()
        for n1, n2 in ((5, 4), (64, 48)):
            probe[f"{dtype} {n1}+{n2}"] = packing_probe(model, n1, n2)
        del model
        _free(opts)
    base = _learner_spec(ctx, opts.max_tokens_per_micro_batch)
    out: dict[str, Any] = {"probe": probe}
    paths = [("padded", False, None), ("packed", True, "sdpa_mask"), ("packed_flex", True, "flex")]
    if opts.device != "cuda":  # FlexAttention has no backward on CPU: a learner refuses it there
        out["packed_flex"] = {"skipped": f"FlexAttention has no backward on {opts.device} (torch {torch.__version__})"}
        paths.pop()
    for name, pack, attention in paths:
        learner = Learner(replace(base, pack_sequences=pack, pack_attention=attention))
        if learner.pack_sequences != pack:
            raise RuntimeError(f"asked for pack_sequences={pack}, the learner resolved {learner.pack_sequences}")
        vocab = int(learner.model.config.vocab_size)
        first = _timed_update(learner, make_ragged_batch(opts, vocab, seed=3), opts.device)
        batch = make_ragged_batch(opts, vocab, seed=4)
        timed = _timed_update(learner, batch, opts.device)
        real = int(batch.attention_mask.sum())
        out[name] = {"attention": str(getattr(learner.model.config, "_attn_implementation", "")),
                     "first_update": first, "update": timed, "real_tokens": real,
                     "real_tokens_per_s": real / timed["seconds"]}
        del learner
        _free(opts)
    padded = out["padded"]["first_update"]
    tol = 1e-4 if opts.dtype == "float32" else 5e-2  # bf16: attention kernels and sums differ by path
    disagree = []
    for name, prefix in (("packed", ""), ("packed_flex", "flex_")):  # packed: sdpa's mask; packed_flex: flex
        if "skipped" in out[name]:
            continue
        packed = out[name]["first_update"]
        # The loss is compared absolutely: with advantages of mean zero (+-0.5 here) and ratios near 1 it is
        # itself near 0, where a relative difference means nothing (the first H200 run: 1.33 "relative").
        loss_diff = abs(packed["loss"] - padded["loss"])
        grad_diff = abs(packed["grad_norm"] - padded["grad_norm"]) / max(padded["grad_norm"], 1e-12)
        seconds = out[name]["update"]["seconds"] / out["padded"]["update"]["seconds"]
        out.update({f"{prefix}loss_abs_diff": loss_diff, f"{prefix}grad_norm_relative_diff": grad_diff,
                    f"time_ratio_{name}_over_padded": seconds})
        if opts.device == "cuda":
            out[f"peak_ratio_{name}_over_padded"] = (out[name]["update"]["peak_bytes"]
                                                     / out["padded"]["update"]["peak_bytes"])
        if not (loss_diff < tol and grad_diff < tol):
            disagree.append(f"{name}: loss {loss_diff:.3g} apart, grad norm {grad_diff:.3g} relative")
    if "time_ratio_packed_flex_over_padded" in out:  # the goal: FlexAttention packing >= 1.3x faster
        out["speedup_packed_flex_over_padded"] = 1 / out["time_ratio_packed_flex_over_padded"]
    if disagree:
        raise PhaseCheckFailed(f"packed and padded updates disagree on one batch: {'; '.join(disagree)} "
                               f"(expected < {tol})", out)
    return out


# ---------------------------------------------------------------------------------------------- push
PUSH_BATCH = 8
"""Trajectories per iteration of the push phase: 4 prompts x 2 rollouts (``sync_group``, so lag must be 0).
The phase's sizes (and lr 1e-6, delta inf) are this check's own: it tests the transfer, not learning."""


def push_config(opts: Options, model: str) -> Any:
    """The push phase's run: one learner actor, one EnvRunner actor, the weights by ``opts.push_route``."""
    from flashrl.algorithms import FlashReinforceConfig

    gpu = opts.device == "cuda"
    share = (0.5 if opts.push_route == "ipc" else 1.0) if gpu else 0.0
    engine_options: dict[str, Any] = {}
    if opts.engine == "vllm":
        engine_options = {"weight_sync": opts.push_route, "dtype": opts.dtype, "enforce_eager": True}
        if gpu:
            engine_options["gpu_memory_utilization"] = opts.gpu_memory_utilization
    return (
        FlashReinforceConfig()
        .environment("flashrl/Math-v0", env_config={"preset": "easy_sums"})
        .env_runners(
            num_env_runners=1,
            num_cpus_per_env_runner=1.0,
            num_gpus_per_env_runner=share,
            engine=opts.engine,
            engine_options=engine_options,
            episodes_in_flight_per_env_runner=PUSH_BATCH,
            max_new_tokens=opts.new_tokens,
            max_episode_tokens=opts.prompt_tokens + opts.new_tokens + 256,
            sample_timeout_s=600.0,
        )
        .learners(num_learners=1, num_cpus_per_learner=1.0, num_gpus_per_learner=share)
        .training(
            model=model,
            dtype=opts.dtype,
            rollout_mode="sync_group",
            group_size=2,
            train_batch_size=PUSH_BATCH,
            lr=1e-6,
            delta=float("inf"),
        )
        .reporting(tensorboard=False, console_every=0)
        .debugging(seed=0)
    )


def push_requirements(opts: Options) -> tuple[str, ...]:
    """Modules the push phase needs: Ray, the Math env's gymnasium and math-verify, vLLM for its engine."""
    return ("ray", "gymnasium", "math_verify") + (("vllm",) if opts.engine == "vllm" else ())


def phase_push(ctx: Context) -> dict[str, Any]:
    """A real run whose weights take ``opts.push_route``; raises if a check fails."""
    import warnings

    import ray

    for name in WEIGHT_SYNC_MODULES:  # fail here, named, if the route's modules do not import
        __import__(name)
    opts, model = ctx.opts, ctx.model
    config = push_config(opts, model)
    started = not ray.is_initialized()
    if started:
        ray.init(
            num_cpus=max(4, os.cpu_count() or 2),
            num_gpus=torch.cuda.device_count() if opts.device == "cuda" else 0,
            include_dashboard=False,
            log_to_driver=False,
        )
    out: dict[str, Any] = {"route_asked": opts.push_route, "iterations": []}
    try:
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # sync_group's "comparison baseline" notice
            algo = config.build_algo()
        out["build_s"] = time.perf_counter() - t0
        try:
            out["route"] = algo._weight_sync.name
            for _ in range(opts.push_iterations):
                r = algo.train()
                out["iterations"].append(
                    {
                        "learner_version": int(r["learners/version"]),
                        "weight_sync_s": float(r["timers/weight_sync_s"]),
                        "policy_lag_max": float(r["env_runners/policy_lag_max"]),
                        "iteration_s": float(r["timers/iteration_s"]),
                    }
                )
            out["num_formations"] = algo._weight_sync.num_formations
        finally:
            algo.stop()
    finally:
        if started:
            ray.shutdown()
    its = out["iterations"]
    if out["route"] != opts.push_route:
        raise RuntimeError(f"the run chose weight_sync {out['route']!r}, expected {opts.push_route!r}")
    if [it["learner_version"] for it in its] != list(range(1, len(its) + 1)):
        raise RuntimeError(f"learner versions {[it['learner_version'] for it in its]}: an update was not applied")
    if any(it["policy_lag_max"] != 0 for it in its):
        raise RuntimeError(f"policy lag {[it['policy_lag_max'] for it in its]}: a batch used weights not yet pushed")
    if not all(it["weight_sync_s"] > 0 for it in its):
        raise RuntimeError("an update reported no weight sync")
    return out


# ---------------------------------------------------------------------------------------------- driver
def missing_modules(names: tuple[str, ...]) -> list[str]:
    """The top-level modules of ``names`` that do not import here."""
    import importlib

    missing = []
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing


def run(opts: Options) -> dict[str, Any]:
    phases: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        arch = architecture(opts)
        t0 = time.perf_counter()
        model = build_model(opts, arch, os.path.join(tmp, "model"))
        ctx = Context(opts, model, arch)
        build_s = time.perf_counter() - t0
        steps: dict[str, Callable[[], dict[str, Any]]] = {
            "matmul": lambda: phase_matmul(ctx),
            "learner": lambda: phase_learner(ctx, phases.get("matmul", {}).get("flops_per_s")),
            "logprobs": lambda: phase_logprobs(ctx),
            "engine": lambda: phase_engine(ctx),
            "fsdp": lambda: phase_fsdp(ctx),
            "packed": lambda: phase_packed(ctx),
            "push": lambda: phase_push(ctx),
        }
        for name in PHASES:
            if name not in opts.phases:
                phases[name] = {"status": "skipped", "reason": "not selected (--phase)"}
                continue
            missing = missing_modules(push_requirements(opts)) if name == "push" else []
            if missing:
                phases[name] = {"status": "skipped", "reason": (
                    f"needs {', '.join(missing)}, not importable here (the GPU machine has no vLLM or Ray, "
                    "and their wheels do not fit what travels to it); run it where they are installed")}
                continue
            print(f"[gpu_check] {name} ...", flush=True)
            t0 = time.perf_counter()
            try:
                phases[name] = {"status": "ok", **steps[name]()}
            except Exception as exc:  # noqa: BLE001 - a failure is this phase's result; the others still run
                phases[name] = {"status": "failed", "error": f"{type(exc).__name__}: {exc}",
                                "traceback": traceback.format_exc(limit=8)[-4000:],
                                **getattr(exc, "measured", {})}
            phases[name]["phase_s"] = time.perf_counter() - t0
            _free(opts)
            print(f"[gpu_check] {name}: {phases[name]['status']} in {phases[name]['phase_s']:.1f} s", flush=True)
    return {
        "check": "gpu_check",
        "mode": "small" if opts.small else "full",
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(opts).items()},
        "model": {**vars(arch), "num_parameters": arch.num_parameters(), "build_s": build_s},
        "machine": _machine(),
        "phases": phases,
        "ok": not any(p["status"] == "failed" for p in phases.values()),
    }


def _machine() -> dict[str, Any]:
    import transformers

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpus": os.cpu_count(),
        "cuda": torch.version.cuda,
    }
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["gpu_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
    return info


def table(result: dict[str, Any]) -> str:
    ph = result["phases"]
    machine = result["machine"]
    rows = [("mode", f"{result['mode']}, python {machine['python']}, torch {machine['torch']}")]
    for name in PHASES:
        p = ph[name]
        if p["status"] != "ok":
            rows.append((name, f"{p['status'].upper()}: {p.get('reason') or p.get('error')}"))
            continue
        if name == "matmul":
            text = f"{p['n']}^3 {p['dtype']}: {p['flops_per_s'] / 1e12:.1f} TFLOP/s"
        elif name == "learner":
            u = p["update"]
            text = (f"{u['tokens']} tokens, {u['num_micro_batches']:.0f} micro-batches: {u['seconds']:.1f} s, "
                    f"{p['tokens_per_s']:.0f} tokens/s, peak {u['peak_bytes'] / GIB:.2f} GiB "
                    + (f" ({p['peak_over_plan']:.2f} x plan)" if p["peak_over_plan"] else ""))
            if "mfu_vs_datasheet" in p:  # the convention first (torchtitan, NeMo), the measured peak beside it
                text += f", MFU {p['mfu_vs_datasheet']:.1%} of the datasheet's {H200_BF16_DENSE_FLOPS / 1e12:.0f} TFLOP/s"
                if "mfu_vs_measured_matmul" in p:
                    text += f" ({p['mfu_vs_measured_matmul']:.1%} of the measured matmul)"
        elif name == "logprobs":
            text = f"{p['logprob_kernel']['kernel']} kernel; " + "; ".join(
                f"{r['tokens']}: "
                + (f"memory {r['memory_ratio_naive_over_chunked']:.1f}x less, "
                   if r["memory_ratio_naive_over_chunked"] else "")
                + f"time {r['time_ratio_chunked_over_naive']:.2f}x, max |d logprob| {r['max_abs_logprob_diff']:.1e}"
                for r in p["rows"]
            )
        elif name == "engine":
            a = p["agreement"]
            text = (f"{p['tokens']} tokens, {p['tokens_per_s']:.0f} tokens/s; |recorded - recomputed| mean "
                    f"{a['mean_abs_diff']:.2e}, max {a['max_abs_diff']:.2e}, drift max {a['max_drift']:.2e}")
        elif name == "fsdp":
            text = (f"{p['backend']}, {p['fsdp_units']} units: {p['update']['seconds']:.1f} s, "
                    f"peak {p['update']['peak_bytes'] / GIB:.2f} GiB")
            if "vs_local" in p:
                text += (f"; vs local: loss {p['vs_local']['loss_abs_diff']:.1e} apart, "
                         f"grad norm {p['vs_local']['grad_norm_relative_diff']:.1e}")
        elif name == "packed":
            text = (f"{p['packed']['real_tokens']} real tokens: {p['padded']['update']['seconds']:.2f} s padded, "
                    f"{p['packed']['update']['seconds']:.2f} s packed sdpa mask ({p['time_ratio_packed_over_padded']:.2f}x)")
            if "peak_ratio_packed_over_padded" in p:
                text += f", peak {p['peak_ratio_packed_over_padded']:.2f}x"
            if "speedup_packed_flex_over_padded" in p:
                text += (f", {p['packed_flex']['update']['seconds']:.2f} s packed flex "
                         f"({p['speedup_packed_flex_over_padded']:.2f}x faster than padded, goal 1.3x)")
            elif "packed_flex" in p:  # runs recorded before the FlexAttention path have no such entry
                text += f", packed flex skipped: {p['packed_flex']['skipped']}"
            text += (f"; loss {p['loss_abs_diff']:.1e}, grad norm {p['grad_norm_relative_diff']:.1e} apart; "
                     "packed vs alone (leak vs alone): " + ", ".join(
                         f"{k} {v['packed_vs_alone']:.1e} ({v['leak_vs_alone']:.2f})" for k, v in p["probe"].items()))
        else:
            its = p["iterations"]
            text = (f"weight_sync {p['route']}: versions {[it['learner_version'] for it in its]}, "
                    f"lag {[it['policy_lag_max'] for it in its]}")
        rows.append((name, text))
    ragged = ragged_rates(ph)
    if ragged:
        rows.append(("ragged", ragged))
    rows.append(("verdict", "OK" if result["ok"] else "FAILED"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def ragged_rates(phases: dict[str, Any]) -> str | None:
    """The ``packed`` phase's ragged batch, padded and packed, beside the ``learner`` phase's uniform one
    (real tokens per second); None unless both phases ran."""
    learner, packed = phases.get("learner", {}), phases.get("packed", {})
    if learner.get("status") != "ok" or packed.get("status") != "ok":
        return None
    uniform = learner["tokens_per_s"]
    return f"real tokens/s vs the uniform batch's {uniform:.0f}: " + ", ".join(
        f"{way} {packed[way]['real_tokens_per_s']:.0f} ({packed[way]['real_tokens_per_s'] / uniform:.2f}x)"
        for way in ("padded", "packed")
    )


def _json_safe(value: Any) -> Any:
    """``value`` with non-finite floats as strings ("inf", "nan"): a figure must not lose the whole JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    if opts.small:
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    result = run(opts)
    print(table(result))
    opts.output.parent.mkdir(parents=True, exist_ok=True)
    opts.output.write_text(json.dumps(_json_safe(result), indent=2, allow_nan=False))
    print(f"wrote {opts.output}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
