"""Peak memory and time of naive vs chunked log-prob + entropy, forward and backward.

The learner needs log p(target) and the entropy at every position. The naive way materialises the
[N, V] float32 log-softmax (and autograd keeps it); the chunked kernel in ``flashrl.ops.logprobs``
keeps only [N] statistics and recomputes chunks in the backward pass. Both run in the same process
on the same inputs; the table reports their ratios.

    python benchmarks/logprob_memory.py                       # V = 151,936, H = 1536, N = 256..2k on CPU
    python benchmarks/logprob_memory.py --tokens 1024 2048 4096 8192 --device cuda

Peak memory on CPU is the growth of the peak resident set size of a fresh child process per
measurement (``resource.getrusage``), so allocator caches of one run do not
hide the next. On CUDA, ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import resource
import time
from pathlib import Path

import torch


def _current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _run(method: str, n: int, vocab: int, hidden: int, chunk: int, device: str, dtype: str) -> dict:
    from flashrl.ops.logprobs import chunked_token_logprobs

    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    h = torch.randn(n, hidden, device=device, dtype=dt, requires_grad=True)
    w = torch.randn(vocab, hidden, device=device, dtype=dt).mul_(hidden**-0.5).requires_grad_()
    targets = torch.randint(0, vocab, (n,), device=device)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _current_rss()
    start = time.perf_counter()
    if method == "naive":
        logp = torch.log_softmax((h @ w.T).float(), -1)  # [N, V] float32, kept for backward
        lp = logp.gather(-1, targets[:, None]).squeeze(-1)
        ent = -(logp.exp() * logp).sum(-1)
    else:
        out = chunked_token_logprobs(h, w, targets, chunk_size=chunk)
        lp, ent = out.logprobs, out.entropy
    (lp.sum() + 0.01 * ent.sum()).backward()
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    seconds = time.perf_counter() - start
    return {"peak_bytes": int(peak), "seconds": seconds, "logprob_sum": float(lp.detach().sum())}


def _child(queue, *args):
    try:
        queue.put(_run(*args))
    except Exception as exc:  # noqa: BLE001  reported in the table, e.g. out of memory
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--tokens", type=int, nargs="+", default=None, help="default: 1k..8k on CUDA, 256..2k on CPU")
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/logprob_memory.json"))
    args = parser.parse_args()
    if args.tokens is None:  # two CPU cores need minutes per point at this vocabulary size
        args.tokens = [1024, 2048, 4096, 8192] if args.device == "cuda" else [256, 512, 1024, 2048]

    rows = []
    for n in args.tokens:
        naive = measure("naive", n, args.vocab, args.hidden, args.chunk_size, args.device, args.dtype)
        chunked = measure("chunked", n, args.vocab, args.hidden, args.chunk_size, args.device, args.dtype)
        row = {"tokens": n, "naive": naive, "chunked": chunked}
        if "error" not in naive and "error" not in chunked:
            row["memory_ratio_naive_over_chunked"] = naive["peak_bytes"] / max(chunked["peak_bytes"], 1)
            row["time_ratio_chunked_over_naive"] = chunked["seconds"] / naive["seconds"]
            row["max_abs_logprob_sum_diff"] = abs(naive["logprob_sum"] - chunked["logprob_sum"])
        rows.append(row)

    print(f"V = {args.vocab}, H = {args.hidden}, chunk = {args.chunk_size}, {args.dtype}, {args.device}")
    print(f"{'tokens':>7} {'naive peak MiB':>15} {'chunked peak MiB':>17} {'mem ratio':>10} "
          f"{'naive s':>8} {'chunked s':>10} {'time ratio':>11}")
    for row in rows:
        nv, ch = row["naive"], row["chunked"]
        if "error" in nv or "error" in ch:
            print(f"{row['tokens']:>7} {nv.get('error', '')} {ch.get('error', '')}")
            continue
        print(f"{row['tokens']:>7} {nv['peak_bytes'] / 2**20:>15.0f} {ch['peak_bytes'] / 2**20:>17.0f} "
              f"{row['memory_ratio_naive_over_chunked']:>9.1f}x {nv['seconds']:>8.2f} {ch['seconds']:>10.2f} "
              f"{row['time_ratio_chunked_over_naive']:>10.2f}x")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "benchmark": "logprob_memory",
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "threads": torch.get_num_threads()},
        "rows": rows,
    }
    args.output.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
