"""Peak learner memory and time per update vs batch size: one padded pass vs micro-batched + packed.

The learner (``flashrl.learners.Learner``) can run an update two ways on the same batch of B
trajectories of T tokens:

- **single pass** (the old path): ``max_tokens_per_micro_batch=None``, ``pack_sequences=False``:
  one forward and backward pass over the whole batch, right-padded (``[B, T]``);
- **micro-batched + packed**: ``max_tokens_per_micro_batch=M``, ``pack_sequences=True``: passes of
  at most M tokens, each packed into one row, gradients accumulated, one optimizer step.

Both give the same update (``tests/learners/test_micro_batches.py``). The model is Qwen2-shaped with
random weights and the real Qwen2 vocabulary (151,936: the output head is most of a small model's
memory), scaled to fit two CPU cores. Both paths run in the same invocation on the same batches; the
table reports their ratios.

    python benchmarks/learner_memory.py                    # B = 4..32, T = 64, M = 256, on CPU
    python benchmarks/learner_memory.py --batch-sizes 8 32 --length 256 --gradient-checkpointing

Each point runs in a fresh child process: the learner is built, AdamW's moments are allocated (one
step at learning rate 0 on zero gradients), then the measured update. Peak memory on CPU is the growth
of the peak resident set size during the measured update over the resident size just before it
(``/proc/self/clear_refs`` resets the peak; glibc's mmap threshold is fixed low so freed tensors
return to the system and cannot hide the next allocation). It is therefore the update's transient
memory: gradients, activations and the log-prob head's buffers (the weights and the optimizer
moments are already resident). On CUDA: ``torch.cuda.max_memory_allocated`` over the allocated bytes
before the update. ``predicted_bytes`` is ``flashrl.plan.memory.learner_memory``'s gradients +
activations for the same point (its check: ``tests/plan/test_memory.py``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

MODEL = {  # Qwen2 layout (flashrl/plan/architectures.py), scaled down; the vocabulary is Qwen2's
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 151_936,
    "tie_word_embeddings": True,
    "max_position_embeddings": 4096,
}
PROMPT_TOKENS = 16
"""Leading tokens of every trajectory outside the loss mask (the prompt)."""


def build_model(out_dir: str, **overrides) -> str:
    """Save a random-weight Qwen2ForCausalLM (float32) with the shape of ``MODEL`` and ``overrides``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**{**MODEL, **overrides})
    Qwen2ForCausalLM(config).save_pretrained(out_dir)
    return out_dir


def make_batch(batch_size: int, length: int, vocab_size: int, seed: int = 0):
    """B trajectories of exactly ``length`` tokens; behavior log-probs near the random model's."""
    from flashrl.learners import TrainBatch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch_size, length), generator=gen)  # [B, T]
    loss_mask = torch.zeros(batch_size, length, dtype=torch.bool)  # [B, T]
    loss_mask[:, PROMPT_TOKENS:] = True
    behavior = torch.full((batch_size, length), -float(torch.log(torch.tensor(vocab_size))))  # [B, T]
    return TrainBatch(
        token_ids=ids,
        attention_mask=torch.ones(batch_size, length, dtype=torch.bool),
        loss_mask=loss_mask,
        behavior_logprobs=behavior.masked_fill(~loss_mask, 0.0),
        rewards=(torch.arange(batch_size) % 2).float(),  # [B]
        policy_versions=torch.zeros(batch_size, dtype=torch.long),
        prompt_ids=[f"p{i}" for i in range(batch_size)],
    )


def _current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size (Linux >= 4.0)


def run_point(
    model: str,
    path: str,
    batch_size: int,
    length: int,
    budget: int,
    chunk: int,
    checkpointing: bool,
    device: str,
) -> dict:
    """One learner, one warm-up update, one measured update; peak bytes above the pre-update size."""
    from flashrl.algorithms.flash_reinforce.learner_loss import FlashReinforceLossSpec
    from flashrl.learners import Learner, LearnerSpec

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    single = path == "single_pass"
    spec = LearnerSpec(
        model=model,
        dtype="float32",
        optimizer="adamw",
        lr=1e-6,
        device=device,
        logprob_chunk_size=chunk,
        gradient_checkpointing=checkpointing,
        max_tokens_per_micro_batch=None if single else budget,
        pack_sequences=not single,
        loss=FlashReinforceLossSpec(delta=float("inf")),
    )
    learner = Learner(spec)
    vocab = learner.model.config.vocab_size
    _allocate_optimizer_state(learner)
    batch = make_batch(batch_size, length, vocab, seed=2)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _current_rss()
        _reset_peak_rss()
    start = time.perf_counter()
    metrics = learner.update(batch)
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = _peak_rss() - base
    seconds = time.perf_counter() - start
    return {
        "peak_bytes": int(peak),
        "seconds": seconds,
        "num_micro_batches": metrics["num_micro_batches"],
        "loss": metrics["loss"],
        "packed": learner.pack_sequences,
    }


def _allocate_optimizer_state(learner) -> None:
    """AdamW allocates its moments at its first step: take one on zero gradients (weights unchanged)."""
    for group in learner.optimizer.param_groups:
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    lr = [group["lr"] for group in learner.optimizer.param_groups]
    for group in learner.optimizer.param_groups:
        group["lr"] = 0.0
    learner.optimizer.step()
    for group, value in zip(learner.optimizer.param_groups, lr):
        group["lr"] = value
    learner.optimizer.zero_grad(set_to_none=True)


def predicted(args, batch_size: int, path: str) -> int:
    """The dry-run formula's transient bytes (gradients + activations) of one point."""
    from flashrl.plan.architectures import Architecture
    from flashrl.plan.memory import learner_memory

    m = MODEL
    arch = Architecture(
        "benchmark",
        "qwen2",
        m["num_hidden_layers"],
        m["hidden_size"],
        m["intermediate_size"],
        m["num_attention_heads"],
        m["num_key_value_heads"],
        m["hidden_size"] // m["num_attention_heads"],
        m["vocab_size"],
        m["tie_word_embeddings"],
        m["max_position_embeddings"],
    )
    mem = learner_memory(
        arch,
        dtype="float32",
        optimizer="adamw",
        train_batch_size=batch_size,
        num_learners=1,
        max_episode_tokens=args.length,
        gradient_checkpointing=args.gradient_checkpointing,
        logprob_chunk_size=args.chunk_size,
        max_tokens_per_micro_batch=None if path == "single_pass" else args.budget,
        pack_sequences=path != "single_pass",  # as run_point's learner (sdpa: its masks are counted)
    )
    return mem.gradients + mem.activations


def _child(queue, *args) -> None:
    try:
        queue.put(run_point(*args))
    except Exception as exc:  # noqa: BLE001 - reported in the table (e.g. out of memory)
        queue.put({"error": f"{type(exc).__name__}: {exc}"})


def measure(*args) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(queue, *args))
    proc.start()
    proc.join()
    if proc.exitcode != 0 and queue.empty():
        return {"error": f"child exited with {proc.exitcode} (likely out of memory)"}
    return queue.get()


PATHS = ("single_pass", "micro_packed")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--length", type=int, default=64, help="tokens per trajectory (all equal)")
    parser.add_argument("--budget", type=int, default=256, help="max_tokens_per_micro_batch of the new path")
    parser.add_argument("--chunk-size", type=int, default=128, help="logprob_chunk_size (both paths)")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--layers", type=int, default=MODEL["num_hidden_layers"])
    parser.add_argument("--hidden", type=int, default=MODEL["hidden_size"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/learner_memory.json"))
    args = parser.parse_args(argv)
    MODEL.update(num_hidden_layers=args.layers, hidden_size=args.hidden)
    # A fixed mmap threshold: tensors freed by one pass go back to the system (children inherit it).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", "65536")

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(tmp)
        for b in args.batch_sizes:
            row: dict = {"batch_size": b, "batch_tokens": b * args.length}
            for path in PATHS:
                row[path] = measure(
                    model,
                    path,
                    b,
                    args.length,
                    args.budget,
                    args.chunk_size,
                    args.gradient_checkpointing,
                    args.device,
                )
                row[path]["predicted_bytes"] = predicted(args, b, path)
            single, micro = row["single_pass"], row["micro_packed"]
            if "error" not in single and "error" not in micro:
                row["memory_ratio_single_over_micro"] = single["peak_bytes"] / max(micro["peak_bytes"], 1)
                row["time_ratio_micro_over_single"] = micro["seconds"] / single["seconds"]
            rows.append(row)
            print(_line(row), flush=True)

    first = next((r for r in rows if "error" not in r["micro_packed"]), None)
    for row in rows:  # growth from the smallest batch, per path
        for path in PATHS:
            if first and "error" not in row[path] and "error" not in first[path]:
                row[path]["peak_over_smallest_batch"] = row[path]["peak_bytes"] / max(
                    first[path]["peak_bytes"], 1
                )
    print(_table(args, rows))
    result = {
        "benchmark": "learner_memory",
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "model": dict(MODEL),
        "machine": {
            "platform": platform.platform(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "cpus": os.cpu_count(),
        },
        "rows": rows,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2, allow_nan=False))
    print(f"wrote {args.output}")
    return result


def _line(row: dict) -> str:
    parts = [f"B={row['batch_size']}"]
    for path in PATHS:
        r = row[path]
        parts.append(
            f"{path}: "
            + (r["error"] if "error" in r else f"{r['peak_bytes'] / 2**20:.0f} MiB {r['seconds']:.1f} s")
        )
    return "  ".join(parts)


def _table(args, rows: list[dict]) -> str:
    mib = 2**20
    lines = [
        (
            f"Qwen2-shaped {MODEL['num_hidden_layers']} layers x hidden {MODEL['hidden_size']}, V = {MODEL['vocab_size']}, "
            f"float32 AdamW, T = {args.length}, budget M = {args.budget}, chunk {args.chunk_size}, "
            f"checkpointing {'on' if args.gradient_checkpointing else 'off'}, {args.device}"
        ),
        (
            "| B | batch tokens | single-pass peak MiB (pred.) | micro+packed peak MiB (pred.) | memory ratio single/micro "
            "| single-pass s | micro+packed s | time ratio micro/single |"
        ),
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        s, m = row["single_pass"], row["micro_packed"]
        if "error" in s or "error" in m:
            lines.append(
                f"| {row['batch_size']} | {row['batch_tokens']} | {s.get('error', '')} | {m.get('error', '')} |"
            )
            continue
        lines.append(
            f"| {row['batch_size']} | {row['batch_tokens']} | {s['peak_bytes'] / mib:.0f} ({s['predicted_bytes'] / mib:.0f}) "
            f"| {m['peak_bytes'] / mib:.0f} ({m['predicted_bytes'] / mib:.0f}) "
            f"| {row['memory_ratio_single_over_micro']:.2f}x | {s['seconds']:.1f} | {m['seconds']:.1f} "
            f"| {row['time_ratio_micro_over_single']:.2f}x |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
