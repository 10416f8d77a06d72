"""One command that checks the GPU path end to end: a 1.5B learner update, vLLM generation, a weight sync.

Run it whenever a GPU machine is available (nothing is downloaded: the model has random weights)::

    python scripts/gpu_check.py                         # Qwen2.5-Math-1.5B shapes, 128 x 4,096 tokens
    python scripts/gpu_check.py --output /tmp/gpu.json  # JSON elsewhere (default benchmarks/results/gpu_check.json)
    python scripts/gpu_check.py --small                 # the same code path on CPU with a tiny model (tests)

What it does, in order, timing each step:

1. builds a Qwen2ForCausalLM with the real Qwen2.5-Math-1.5B shapes (``flashrl/recipes/architectures.py``)
   and random bfloat16 weights, saved as a Hugging Face folder with the SmolLM2 tokenizer
   (``flashrl.models.resolve_model``, offline); the config keeps Qwen2's 151,936-row vocabulary, which
   pads the tokenizer's 49,152 tokens (ids above it are never decoded: the engine does not detokenize);
2. starts vLLM's GPU build on it (``flashrl.engines.make_engine("vllm", ...)``) and generates
   ``--prompts`` completions, checking that every token carries a finite recorded log-prob <= 0;
3. takes learner updates (``flashrl.learners.Learner``) on a batch of ``--batch-size`` x ``--length``
   tokens, micro-batched under ``--max-tokens-per-micro-batch``, with gradient checkpointing; with
   ``--num-learners`` >= 2 the learners are FSDP2 ranks (one process per GPU, NCCL; gloo on CPU), else
   one full-replica learner. Reports the second update's seconds and the peak memory
   (``torch.cuda.max_memory_allocated``; on CPU the peak resident set size);
4. syncs the updated weights into the engine (``Learner.get_weights`` + ``Engine.update_weights``,
   seconds each) and generates again with the new version;
5. ``--phase push`` (or ``all``): the run's own weight-sync route, end to end through Ray. A
   FlashREINFORCE run (``FlashReinforceConfig().build_algo()``) on the same model with one learner
   actor and one EnvRunner actor hosting vLLM, ``engine_options={"weight_sync": --push-route}``:
   ``ipc`` (the default on one GPU: learner and engine share it, half each) or ``nccl`` (the default
   with two or more: a GPU each). It takes ``--push-iterations`` synchronous iterations and checks
   that the algorithm chose the push route, that every update was pushed (learner versions 1, 2,
   ...) and that every batch after the first was sampled from the version just pushed (policy lag 0
   in ``sync_group`` mode), and records each push's seconds. ``--small`` runs the same phase on CPU
   with the ``shm`` route (CPU cannot push): the run, not the transfer.

Prints a table and writes JSON. The default ``--phase update`` (steps 1-4) is sized to finish in under
8 minutes on one H200 (the engine is started first with a fixed share of the GPU,
``--gpu-memory-utilization``, so the learner can use the rest); run ``--phase push`` as a second
command (a few minutes: Ray, the engine in its actor, the learner, the iterations)::

    python scripts/gpu_check.py --phase push --output benchmarks/results/gpu_check_push.json
 ``--small`` (alias ``--dry-run``) runs every step on CPU with a tiny Llama, two gloo FSDP2
ranks and the torch engine unless ``--engine vllm`` is given; ``tests/scripts/test_gpu_check.py``
runs it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import queue
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

QWEN25_MATH_1P5B = {  # flashrl/recipes/architectures.py: Qwen/Qwen2.5-Math-1.5B
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "vocab_size": 151_936,
    "tie_word_embeddings": True,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
}
TINY = {  # --small: the shape of flashrl.models.tiny (head_dim 64: vLLM's CPU attention needs >= 32), as Qwen2
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "tie_word_embeddings": True,
    "max_position_embeddings": 512,
}


@dataclass
class Options:
    small: bool
    engine: str
    num_learners: int
    batch_size: int
    length: int
    max_tokens_per_micro_batch: int
    prompts: int
    prompt_tokens: int
    new_tokens: int
    gpu_memory_utilization: float
    output: Path
    phase: str = "update"
    push_route: str = "shm"
    push_iterations: int = 3
    workdir: str = ""

    @property
    def device(self) -> str:
        return "cpu" if self.small else "cuda"

    @property
    def dtype(self) -> str:
        return "float32" if self.small else "bfloat16"


def parse_args(argv: list[str] | None = None) -> Options:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--small",
        "--dry-run",
        dest="small",
        action="store_true",
        help="tiny model on CPU (two gloo ranks, torch engine): the same code path, for tests",
    )
    p.add_argument(
        "--engine", choices=["vllm", "torch"], default=None, help="default: vllm (torch with --small)"
    )
    p.add_argument(
        "--num-learners",
        type=int,
        default=None,
        help="FSDP2 ranks (default: the visible GPUs, at most 8; 2 with --small)",
    )
    p.add_argument("--batch-size", type=int, default=None, help="trajectories (default 128; 8 with --small)")
    p.add_argument(
        "--length", type=int, default=None, help="tokens per trajectory (default 4096; 48 with --small)"
    )
    p.add_argument(
        "--max-tokens-per-micro-batch", type=int, default=None, help="default 16384 (96 with --small)"
    )
    p.add_argument(
        "--prompts", type=int, default=None, help="completions to generate (default 64; 4 with --small)"
    )
    p.add_argument(
        "--new-tokens", type=int, default=None, help="tokens per completion (default 512; 8 with --small)"
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="vLLM's share of the GPU")
    p.add_argument("--output", type=Path, default=Path("benchmarks/results/gpu_check.json"))
    p.add_argument(
        "--phase",
        choices=["update", "push", "all"],
        default="update",
        help="update: steps 1-4 (default); push: step 5, the run's weight-sync route through Ray; all: both",
    )
    p.add_argument(
        "--push-route",
        choices=["ipc", "nccl", "shm"],
        default=None,
        help="weight_sync of step 5 (default: ipc on one GPU, nccl on several, shm with --small)",
    )
    p.add_argument("--push-iterations", type=int, default=3, help="iterations of step 5 (>= 2)")
    a = p.parse_args(argv)
    small = a.small
    gpus = torch.cuda.device_count()
    if not small and gpus == 0:
        p.error("no CUDA GPU is visible; run with --small to check the code path on CPU")
    route = a.push_route or ("shm" if small else ("ipc" if gpus == 1 else "nccl"))
    if small and route != "shm":
        p.error(f"--push-route {route} needs a GPU (vLLM's transfer engines live in its GPU worker); use shm")
    if route == "nccl" and not small and gpus < 2:
        p.error("--push-route nccl needs two GPUs (NCCL cannot put two ranks on one device); use ipc")
    if a.push_iterations < 2:
        p.error(f"--push-iterations: expected >= 2 (a batch sampled after a push), got {a.push_iterations}")
    return Options(
        small=small,
        engine=a.engine or ("torch" if small else "vllm"),
        num_learners=a.num_learners or (2 if small else max(1, min(gpus, 8))),
        batch_size=a.batch_size or (8 if small else 128),
        length=a.length or (48 if small else 4096),
        max_tokens_per_micro_batch=a.max_tokens_per_micro_batch or (96 if small else 16384),
        prompts=a.prompts or (4 if small else 64),
        prompt_tokens=16 if small else 256,
        new_tokens=a.new_tokens or (8 if small else 512),
        gpu_memory_utilization=a.gpu_memory_utilization,
        output=a.output,
        phase=a.phase,
        push_route=route,
        push_iterations=a.push_iterations,
    )


# ---------------------------------------------------------------------------------------------- model
def build_model(opts: Options, out_dir: str) -> tuple[str, dict[str, Any]]:
    """Random weights with the chosen shape, saved with the SmolLM2 tokenizer; returns (folder, shape)."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from flashrl.models import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"))
    shape = dict(TINY, vocab_size=len(tokenizer)) if opts.small else dict(QWEN25_MATH_1P5B)
    if shape["vocab_size"] < len(tokenizer):
        raise ValueError(f"vocab_size {shape['vocab_size']} < the tokenizer's {len(tokenizer)} tokens")
    config = Qwen2Config(
        **shape,
        bos_token_id=tokenizer.bos_token_id,
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
    if opts.device == "cuda":
        torch.cuda.empty_cache()
    return out_dir, shape


def make_batch(opts: Options, vocab: int, seed: int):
    """``batch_size`` trajectories of exactly ``length`` tokens, a 64-token prompt outside the loss."""
    from flashrl.learners import TrainBatch

    gen = torch.Generator().manual_seed(seed)
    b, t = opts.batch_size, opts.length
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


# ---------------------------------------------------------------------------------------------- engine
def start_engine(opts: Options, model: str):
    from flashrl.engines import make_engine

    context = opts.prompt_tokens + opts.new_tokens
    if opts.engine == "torch":
        return make_engine(
            "torch", model, seed=0, dtype=opts.dtype, device=opts.device, max_model_len=context
        )
    options: dict[str, Any] = {
        "dtype": opts.dtype,
        "max_model_len": context,
        "max_num_seqs": opts.prompts,
        "enforce_eager": True,
    }
    if opts.device == "cuda":
        options["gpu_memory_utilization"] = opts.gpu_memory_utilization
    return make_engine("vllm", model, seed=0, **options)


async def generate(engine, opts: Options, vocab: int, seed: int) -> dict[str, Any]:
    """``prompts`` completions of random prompts; every token's recorded log-prob must be finite and <= 0."""
    from flashrl.engines.types import SamplingConfig

    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, vocab, (opts.prompts, opts.prompt_tokens), generator=gen).tolist()
    sampling = SamplingConfig(temperature=1.0, max_tokens=opts.new_tokens, seed=seed)
    start = time.perf_counter()
    done = await asyncio.gather(*(engine.generate(p, sampling) for p in prompts))
    seconds = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for c in done)
    logprobs = [lp for c in done for lp in c.logprobs]
    bad = sum(1 for lp in logprobs if not (math.isfinite(lp) and lp <= 1e-6))
    if bad or len(logprobs) != tokens or tokens == 0:
        raise RuntimeError(
            f"{bad} of {len(logprobs)} recorded log-probs are not finite and <= 0 ({tokens} tokens)"
        )
    return {
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "mean_logprob": sum(logprobs) / len(logprobs),
        "versions": sorted({c.version for c in done}),
    }


# ---------------------------------------------------------------------------------------------- learner
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


def learner_updates(opts: Options, model: str, rank: int, world: int) -> tuple[Any, dict[str, Any]]:
    """Build the learner (FSDP2 when world >= 2), take two updates; the learner and rank's figures."""
    from flashrl.algorithms.flash_reinforce.learner_loss import FlashReinforceLoss
    from flashrl.learners import Learner, LearnerSpec

    device = f"cuda:{rank}" if opts.device == "cuda" else "cpu"
    spec = LearnerSpec(
        model=model,
        dtype=opts.dtype,
        optimizer="adamw",
        lr=1e-6,
        betas=(0.9, 0.95),
        weight_decay=0.1,
        device=device,
        gradient_checkpointing=True,
        max_tokens_per_micro_batch=opts.max_tokens_per_micro_batch,
        loss=FlashReinforceLoss(delta=0.003),
    )
    t0 = time.perf_counter()
    learner = Learner(spec, rank=rank, world_size=world)
    build_s = time.perf_counter() - t0
    vocab = int(learner.model.config.vocab_size)
    updates = []
    for seed in (1, 2):  # the first update also pays for kernel warm-up and AdamW's allocation
        batch = make_batch(opts, vocab, seed)
        _peak_reset(opts.device)
        start = time.perf_counter()
        metrics = learner.update(batch)
        updates.append(
            {
                "seconds": time.perf_counter() - start,
                "peak_bytes": _peak(opts.device),
                "applied": metrics["applied"],
                "num_micro_batches": metrics.get("num_micro_batches"),
                "loss": metrics.get("loss"),
            }
        )
    return learner, {
        "build_s": build_s,
        "updates": updates,
        "packed": learner.pack_sequences,
        "sharded": world > 1,
    }


# ---------------------------------------------------------------------------------------------- ranks
def rank_main(rank: int, world: int, opts: Options, model: str, port: int, results: Any) -> None:
    """One learner rank; rank 0 also hosts the engine (started before the learner takes its memory)."""
    from flashrl.learners import distributed

    if world > 1:
        if opts.device == "cuda":
            torch.cuda.set_device(rank)
        distributed.init_process_group(
            master_addr="127.0.0.1",
            master_port=port,
            rank=rank,
            world_size=world,
            backend="nccl" if opts.device == "cuda" else "gloo",
            timeout_s=600,
        )
    out: dict[str, Any] = {}
    engine = None
    loop = asyncio.new_event_loop()
    try:
        if rank == 0:
            t0 = time.perf_counter()
            engine = start_engine(opts, model)
            out["engine_start_s"] = time.perf_counter() - t0
            vocab = len(engine.tokenizer)
            out["generate_before"] = loop.run_until_complete(generate(engine, opts, vocab, seed=0))
        learner, out["learner"] = learner_updates(opts, model, rank, world)
        t0 = time.perf_counter()
        weights = learner.get_weights()  # a collective when sharded; {} on ranks > 0
        out["get_weights_s"] = time.perf_counter() - t0
        if rank == 0:
            out["weights_bytes"] = sum(
                t.numel() * t.element_size() for t in {id(t): t for t in weights.values()}.values()
            )
            t0 = time.perf_counter()
            loop.run_until_complete(engine.update_weights(weights, version=1))
            out["update_weights_s"] = time.perf_counter() - t0
            out["generate_after"] = loop.run_until_complete(
                generate(engine, opts, len(engine.tokenizer), seed=1)
            )
            if out["generate_after"]["versions"] != [1]:
                raise RuntimeError(
                    f"after the sync the engine served versions {out['generate_after']['versions']}"
                )
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        pending = asyncio.all_tasks(loop)  # e.g. vLLM's output handler: cancelled, not left to a closed loop
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        if engine is not None:
            engine.close()
        loop.close()
        results.put((rank, out))
        if world > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


# ---------------------------------------------------------------------------------------------- push
PUSH_BATCH = 8
"""Trajectories per iteration of step 5: 4 prompts x 2 rollouts (``sync_group``, so lag must be 0).
The step's sizes (and lr 1e-6, delta inf) are this check's own: it tests the transfer, not learning."""


def push_config(opts: Options, model: str) -> Any:
    """Step 5's run: one learner actor, one EnvRunner actor, the weights by ``opts.push_route``."""
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


def push_run(opts: Options, model: str) -> dict[str, Any]:
    """Step 5: iterations of a real run whose weights take ``opts.push_route``; raises if a check fails."""
    import warnings

    import ray

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(opts: Options) -> dict[str, Any]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    outs: dict[int, dict[str, Any]] = {}
    procs: list[Any] = []
    errors: dict[Any, str] = {}
    push: dict[str, Any] | None = None
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        model, shape = build_model(opts, os.path.join(tmp, "model"))
        build_s = time.perf_counter() - t0
        if opts.phase in ("update", "all"):
            port = _free_port()
            procs = [
                ctx.Process(target=rank_main, args=(r, opts.num_learners, opts, model, port, results))
                for r in range(opts.num_learners)
            ]
            for proc in procs:
                proc.start()
            while len(outs) < len(procs) and (any(p.is_alive() for p in procs) or not results.empty()):
                try:
                    rank, out = results.get(timeout=5)
                    outs[rank] = out
                except queue.Empty:  # keep waiting while a rank is alive
                    continue
            for proc in procs:
                proc.join()
        if opts.phase in ("push", "all"):  # after the ranks: their GPU memory is free again
            try:
                push = push_run(opts, model)
            except Exception as exc:  # noqa: BLE001 - any failure is the check's result: table, JSON, exit 1
                push = {"error": f"{type(exc).__name__}: {exc}"}
                errors["push"] = push["error"]
    errors.update({r: o["error"] for r, o in outs.items() if "error" in o})
    errors.update({r: f"rank exited with {p.exitcode}" for r, p in enumerate(procs) if r not in outs})
    result = {
        "check": "gpu_check",
        "mode": "small" if opts.small else "full",
        "options": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(opts).items() if k != "workdir"
        },
        "model": {**shape, "build_s": build_s},
        "machine": _machine(),
        "ranks": {str(r): outs[r] for r in sorted(outs)},
        "push": push,
        "errors": {str(r): e for r, e in sorted(errors.items(), key=lambda kv: str(kv[0]))},
        "ok": not errors,
    }
    return result


def _machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
    }
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    try:
        import vllm

        info["vllm"] = vllm.__version__
    except ImportError:
        info["vllm"] = None
    return info


def table(result: dict[str, Any]) -> str:
    gib = 2**30
    o = result["options"]
    rank0 = result["ranks"].get("0", {})
    learner = rank0.get("learner", {})
    ups = learner.get("updates", [])
    rows = [
        (
            "mode",
            f"{result['mode']}, phase {o['phase']}, {o['num_learners']} learner(s)"
            + (" (FSDP2)" if learner.get("sharded") else " (one full replica)")
            + f", engine {o['engine']}",
        ),
        ("model build + save", f"{result['model']['build_s']:.1f} s"),
        ("engine start", _s(rank0.get("engine_start_s"))),
    ]
    for key, label in (
        ("generate_before", "generate (before sync)"),
        ("generate_after", "generate (after sync)"),
    ):
        g = rank0.get(key)
        if g:
            rows.append(
                (
                    label,
                    (
                        f"{g['tokens']} tokens in {g['seconds']:.1f} s ({g['tokens_per_s']:.0f} tokens/s), "
                        f"mean log-prob {g['mean_logprob']:.2f}, versions {g['versions']}"
                    ),
                )
            )
    for i, u in enumerate(ups):
        rows.append(
            (
                f"learner update {i + 1}",
                (
                    f"{o['batch_size']} x {o['length']} tokens, {u['num_micro_batches']:.0f} micro-batches, "
                    f"{u['seconds']:.1f} s, peak {u['peak_bytes'] / gib:.2f} GiB (rank 0)"
                ),
            )
        )
    rows += [
        ("get_weights", _s(rank0.get("get_weights_s"))),
        (
            "update_weights (sync)",
            _s(rank0.get("update_weights_s"))
            + (f", {rank0['weights_bytes'] / gib:.2f} GiB" if "weights_bytes" in rank0 else ""),
        ),
    ]
    push = result.get("push")
    if push and "iterations" in push:
        syncs = ", ".join(f"{it['weight_sync_s']:.2f}" for it in push["iterations"])
        rows.append(
            (
                "push route (step 5)",
                (
                    f"weight_sync {push.get('route')}: {len(push['iterations'])} iterations, versions "
                    f"{[it['learner_version'] for it in push['iterations']]}, policy lag "
                    f"{[it['policy_lag_max'] for it in push['iterations']]}, sync s [{syncs}]"
                ),
            )
        )
    if result["errors"]:
        rows.append(("errors", json.dumps(result["errors"])))
    rows.append(("verdict", "OK" if result["ok"] else "FAILED"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    if opts.small:
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    result = run(opts)
    print(table(result))
    opts.output.parent.mkdir(parents=True, exist_ok=True)
    opts.output.write_text(json.dumps(result, indent=2, allow_nan=False))
    print(f"wrote {opts.output}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
