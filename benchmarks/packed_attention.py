"""Packed passes by attention kernel against padding: time and memory on one ragged batch.

The learner's forward path (``flashrl.models.compute_token_logprobs`` padded,
``flashrl.models.compute_packed_token_logprobs`` packed) on B trajectories of very different lengths
(evenly spaced from ``--min-length`` to ``--max-length`` tokens), three ways:

- **padded**: ``[B, T]`` right-padded rows, sdpa's causal kernel (``pack_sequences=False``);
- **packed sdpa_mask**: one row of the real tokens, sdpa with the materialised ``[N, N]``
  block-diagonal mask (``pack_attention="sdpa_mask"``, the CPU default);
- **packed flex**: the same row, FlexAttention with transformers' document ``BlockMask``
  (``pack_attention="flex"``, the CUDA default), compiled. On CPU it runs forward only: torch's
  FlexAttention has no backward there (``flashrl.models.packed_attention``).

Each path is timed for a forward without gradients (the log-probs a learner recomputes) and, where
it can, for a forward and backward (a training pass), median of ``--repeats`` after one warm-up
(which also compiles FlexAttention). Each path runs in a fresh child process; its peak memory on
CPU is the growth of the peak resident set during its measured passes (``benchmarks/learner_memory.py``'s
method), on CUDA ``torch.cuda.max_memory_allocated`` above the allocation before them. The model is
Qwen2-shaped with random weights (float32).

    python benchmarks/packed_attention.py          # 8 trajectories of 128..1024 tokens, on CPU
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
from learner_memory import _current_rss, _peak_rss, _reset_peak_rss, build_model

PATHS = ("padded", "packed_sdpa_mask", "packed_flex")
MODEL = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 32_768, "max_position_embeddings": 4096}
"""Small enough for two CPU cores, with attention a real share of the pass at 1,024 tokens."""


def ragged_rows(batch_size: int, shortest: int, longest: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded token ids [B, T] and attention mask [B, T], lengths evenly spaced shortest..longest."""
    lengths = torch.linspace(shortest, longest, batch_size).round().long()  # [B]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (batch_size, longest), generator=gen)  # [B, T]
    mask = torch.arange(longest).unsqueeze(0) < lengths.unsqueeze(1)  # [B, T]
    return ids.masked_fill(~mask, 0), mask


def run_path(model_dir: str, path: str, args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM

    from flashrl.learners.packing import pack_rows, unpack_rows
    from flashrl.models import compute_packed_token_logprobs, compute_token_logprobs

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    implementation = {"padded": "sdpa", "packed_sdpa_mask": "sdpa", "packed_flex": "flex_attention"}[path]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation=implementation).to(device).eval()
    ids, mask = ragged_rows(args.batch_size, args.min_length, args.max_length, model.config.vocab_size)
    ids, mask = ids.to(device), mask.to(device)
    packed = pack_rows(ids, mask)

    def forward() -> torch.Tensor:
        if path == "padded":
            return compute_token_logprobs(model, ids, mask, with_entropy=False)[0]  # [B, T]
        lp, _ = compute_packed_token_logprobs(model, packed.input_ids, packed.position_ids, with_entropy=False,
                                              check_positions=False)  # [1, N]
        return unpack_rows(lp, packed)  # [B, T]

    def train_pass() -> None:
        model.zero_grad(set_to_none=True)
        forward().sum().backward()

    def no_grad_pass() -> None:
        with torch.no_grad():
            forward()

    modes = {"forward": no_grad_pass}
    if not (path == "packed_flex" and device.type == "cpu"):
        modes["forward_backward"] = train_pass
    out: dict = {"attention": model.config._attn_implementation, "real_tokens": int(mask.sum()),
                 "padded_tokens": int(mask.numel())}
    for mode, fn in modes.items():
        start = time.perf_counter()
        fn()  # warm-up (compiles FlexAttention)
        warmup = time.perf_counter() - start
        _sync(device)
        before = torch.cuda.memory_allocated() if device.type == "cuda" else _current_rss()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        else:
            _reset_peak_rss()
        seconds = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            fn()
            _sync(device)
            seconds.append(time.perf_counter() - start)
        peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else _peak_rss()
        out[mode] = {"seconds": statistics.median(seconds), "all_seconds": seconds, "warmup_seconds": warmup,
                     "peak_bytes": peak - before}
    if "forward_backward" not in modes:
        out["forward_backward"] = {"skipped": f"FlexAttention has no backward on CPU (torch {torch.__version__})"}
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(*args) -> dict:
    """``run_path(*args)`` in a fresh process (its own peak memory, its own compiled kernels)."""
    try:
        with ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn")) as pool:
            return pool.submit(run_path, *args).result()
    except Exception as exc:  # noqa: BLE001 - reported in the table
        return {"error": f"{type(exc).__name__}: {exc}"}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--min-length", type=int, default=128)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on shared cores)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/packed_attention.json"))
    args = parser.parse_args(argv)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # freed tensors return to the system
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", "65536")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(str(Path(tmp) / "model"), **MODEL)
        results = {path: measure(model_dir, path, args) for path in PATHS}
    for path in PATHS[1:]:
        for mode in ("forward", "forward_backward"):
            ours, padded = results[path].get(mode, {}), results["padded"].get(mode, {})
            if "seconds" in ours and "seconds" in padded:
                results[path][mode]["speedup_over_padded"] = padded["seconds"] / ours["seconds"]
    report = {"benchmark": "packed_attention", "args": {k: str(v) if isinstance(v, Path) else v
                                                        for k, v in vars(args).items()},
              "model": MODEL, "torch": torch.__version__, "machine": platform.machine(),
              "cpu_count": os.cpu_count(), "load_average": os.getloadavg(), "results": results}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(_table(results))
    return report


def _table(results: dict) -> str:
    header = ("| path | attention | forward s | fwd speedup vs padded | fwd peak MiB | fwd+bwd s | fwd+bwd speedup "
              "| fwd+bwd peak MiB |")
    lines = [header, "|---|---|---|---|---|---|---|---|"]
    for path, row in results.items():
        if "error" in row:
            lines.append(f"| {path} | error: {row['error']} |")
            continue
        cells = [path, row["attention"]]
        for mode in ("forward", "forward_backward"):
            r = row[mode]
            if "skipped" in r:
                cells += ["n/a (no CPU backward)", "", ""]
                continue
            cells += [f"{r['seconds']:.3f}", f"{r.get('speedup_over_padded', 1.0):.2f}x",
                      f"{r['peak_bytes'] / 2**20:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
