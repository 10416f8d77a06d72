"""Weight sync into the vLLM engine: one update's seconds vs the bytes moved and a memcpy bound.

For each model, in one run and one engine: a plain memory copy of the model's bytes (the bound),
one update as a single bucket (the whole model in one shared-memory file, what flashrl did before
streaming), and streamed updates in buckets of a few sizes (``WeightBuckets`` from the learner
helper, one bucket file at a time). Each row reports seconds, GB/s, the ratio to the memcpy bound,
the number of buckets and the largest bucket file (what ``/dev/shm`` must hold).

With ``--lora-ranks``, the run instead compares the push of a LoRA run with the full push of the same
model: the full weights through the ``shm`` stream into a plain vLLM engine, and for each rank a peft
adapter (``flashrl.models.lora``, every linear layer) through the ``lora`` route's stream into a vLLM
engine started with that adapter option (``flashrl.weight_sync.lora``; the engine writes each version
as a PEFT folder and loads it as a new ``LoRARequest``). Each push is timed ``--repeats`` times and the
median kept, as is the first token sampled after it (vLLM activates an adapter on its first request);
the rows give bytes and seconds as ratios to the full push.

Usage::

    python benchmarks/weight_sync.py                       # the tiny random Llama and SmolLM2-135M
    python benchmarks/weight_sync.py --models tiny --repeats 3
    python benchmarks/weight_sync.py --models smollm2-135m-instruct --lora-ranks 16 64 --repeats 5

Prints a table and writes JSON (default ``benchmarks/results/weight_sync.json``; with ``--lora-ranks``,
``benchmarks/results/weight_sync_lora.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

MIB = 2**20


def memcpy_seconds(state: dict[str, torch.Tensor], buffers: list[torch.Tensor]) -> float:
    """One plain copy of every tensor into preallocated (already touched) buffers."""
    start = time.perf_counter()
    for dst, src in zip(buffers, state.values()):
        dst.copy_(src)
    return time.perf_counter() - start


def update_seconds(
    engine: Any, model: torch.nn.Module, bucket_bytes: int | None, loop, version: int
) -> tuple[float, int, int]:
    """One update; (seconds, buckets, largest bucket file bytes)."""
    from flashrl.learners.weight_gather import iter_weight_buckets, weight_manifest
    from flashrl.weight_sync.buckets import as_buckets
    from flashrl.weight_sync.shm import bucket_file_bytes
    from flashrl.weight_sync.wire import WeightBuckets

    if bucket_bytes is None:  # the whole state dict in one bucket: the single-file path
        engine.options = dataclasses.replace(engine.options, weight_bucket_bytes=2**62)
        state = model.state_dict()
        # a tied head is one tensor: sent once (the engine would leave out a second copy too)
        weights: Any = {m.name: state[m.name] for b in weight_manifest(model, bucket_bytes=2**62) for m in b}
        manifest = as_buckets(weights, 2**62).manifest
    else:
        manifest = weight_manifest(model, bucket_bytes=bucket_bytes)
        weights = WeightBuckets(manifest, iter_weight_buckets(model, manifest))
    start = time.perf_counter()
    loop.run_until_complete(engine.update_weights(weights, version=version))
    return time.perf_counter() - start, len(manifest), max(bucket_file_bytes(b) for b in manifest)


def measure(name: str, path: str, bucket_sizes: list[int], repeats: int) -> list[dict[str, Any]]:
    from transformers import AutoModelForCausalLM

    from flashrl.engines import make_engine
    from flashrl.learners.weight_gather import weight_manifest

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    state = {n: t for n, t in model.state_dict().items()}
    nbytes = sum(t.nbytes for t in {t.data_ptr(): t for t in state.values()}.values())  # a tied head once
    loop = asyncio.new_event_loop()
    engine = make_engine("vllm", path, seed=0, max_model_len=256, max_num_seqs=4)
    rows = []
    unique = {m.name: state[m.name] for b in weight_manifest(model, bucket_bytes=2**62) for m in b}
    buffers = [t.clone() for t in unique.values()]  # allocated and touched once, outside the timing
    copies: list[float] = []
    try:
        version = 0
        # Each update is timed right after a memcpy of the same bytes, so both see the same load
        # (these machines are shared): the bound is the best memcpy of the run.
        for bucket in [None, *bucket_sizes]:
            best = float("inf")
            for _ in range(repeats):
                copies.append(memcpy_seconds(unique, buffers))
                version += 1
                seconds, buckets, largest = update_seconds(engine, model, bucket, loop, version)
                best = min(best, seconds)
            rows.append({"model": name, "path": "single file" if bucket is None else "streamed",
                         "bucket_bytes": bucket, "seconds": best, "buckets": buckets,
                         "largest_file_bytes": largest})  # fmt: skip
        bound = min(copies)
        rows.insert(0, {"model": name, "path": "memcpy (bound)", "bucket_bytes": None, "seconds": bound})
    finally:
        close_engine(engine, loop)
        loop.close()
    for row in rows:
        row["bytes"] = nbytes
        row["memcpy_samples_s"] = copies if row["path"].startswith("memcpy") else None
        row["gb_per_s"] = nbytes / row["seconds"] / 1e9
        row["x_memcpy"] = row["seconds"] / bound
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | path | bucket | buckets | largest file | seconds | GB/s | x memcpy |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in rows:
        bucket = "-" if r["bucket_bytes"] is None else f"{r['bucket_bytes'] / MIB:g} MiB"
        largest = f"{r['largest_file_bytes'] / MIB:.1f} MiB" if "largest_file_bytes" in r else "-"
        lines.append(
            f"| {r['model']} | {r['path']} | {bucket} | {r.get('buckets', '-')} | {largest} | "
            f"{r['seconds']:.3f} | {r['gb_per_s']:.2f} | {r['x_memcpy']:.1f} |"
        )
    return "\n".join(lines)


def first_token_seconds(engine: Any, loop, prompt: list[int]) -> float:
    """One greedy token after a push: what a request waits for the pushed version (an adapter is activated here)."""
    from flashrl.engines import SamplingConfig

    start = time.perf_counter()
    loop.run_until_complete(engine.generate(prompt, SamplingConfig(max_tokens=1, temperature=0.0)))
    return time.perf_counter() - start


def push_samples(
    engine: Any, model: torch.nn.Module, loop, repeats: int, *, adapter: bool
) -> dict[str, Any]:
    """``repeats`` pushes of ``model`` (its adapter only with ``adapter``) into ``engine``, as a run streams them."""
    from flashrl.learners.weight_gather import iter_weight_buckets, weight_manifest
    from flashrl.models.lora import is_adapter_name
    from flashrl.weight_sync.shm import bucket_file_bytes
    from flashrl.weight_sync.wire import WeightBuckets

    select = is_adapter_name if adapter else None  # what the learner's PolicyWeights selects in a LoRA run
    prompt = engine.tokenizer("The weights of version").input_ids
    seconds, first = [], []
    for version in range(1, repeats + 1):
        manifest = weight_manifest(model, select=select)  # the default bucket size, as a run sends it
        weights = WeightBuckets(manifest, iter_weight_buckets(model, manifest, select=select))
        start = time.perf_counter()
        loop.run_until_complete(engine.update_weights(weights, version=version))
        seconds.append(time.perf_counter() - start)
        first.append(first_token_seconds(engine, loop, prompt))
    return {"tensors": sum(len(b) for b in manifest), "bytes": sum(bucket_file_bytes(b) for b in manifest),
            "seconds_samples": seconds, "seconds": statistics.median(seconds),
            "first_token_samples_s": first, "first_token_s": statistics.median(first)}  # fmt: skip


def close_engine(engine: Any, loop) -> None:
    """Stop ``engine`` and finish the tasks it leaves on ``loop``."""
    engine.close()
    pending = asyncio.all_tasks(loop)  # vLLM's output handler, cancelled by close()
    for task in pending:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))


def measure_lora(name: str, path: str, ranks: list[int], repeats: int) -> list[dict[str, Any]]:
    """The full push and each rank's adapter push of one model, each into its own vLLM engine, in one run."""
    from transformers import AutoModelForCausalLM

    from flashrl.engines import make_engine
    from flashrl.models.lora import LoRASettings, apply_lora

    rows = []
    for rank in [None, *ranks]:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        options: dict[str, Any] = {}
        if rank is not None:
            settings = LoRASettings(rank=rank, alpha=2.0 * rank)  # flashrl's defaults: all-linear, no dropout
            apply_lora(model, settings)
            gen = torch.Generator().manual_seed(rank)
            with torch.no_grad():  # a trained adapter (peft starts lora_B at zero)
                for pname, p in model.named_parameters():
                    if ".lora_B." in pname:
                        p.copy_(0.01 * torch.randn(p.shape, generator=gen))
            options = {"weight_sync": "lora", "lora": settings.to_dict()}
        loop = asyncio.new_event_loop()
        engine = make_engine("vllm", path, seed=0, max_model_len=256, max_num_seqs=4, **options)
        try:
            row = push_samples(engine, model, loop, repeats, adapter=rank is not None)
        finally:
            close_engine(engine, loop)
            loop.close()
        rows.append({"model": name, "push": "full (shm)" if rank is None else "adapter (lora)", "rank": rank,
                     "route": engine.weight_sync, **row})  # fmt: skip
        del model, engine
    full = rows[0]
    for row in rows:
        row["x_full_bytes"] = row["bytes"] / full["bytes"]
        row["x_full_seconds"] = row["seconds"] / full["seconds"]
    return rows


def lora_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | push | rank | tensors | MiB | seconds (median) | first token s | x bytes | x seconds |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['push']} | {r['rank'] or '-'} | {r['tensors']} | {r['bytes'] / MIB:.2f} | "
            f"{r['seconds']:.4f} | {r['first_token_s']:.4f} | {r['x_full_bytes']:.4f} | {r['x_full_seconds']:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--models", nargs="+", default=["tiny", "smollm2-135m-instruct"],
                        help="'tiny' (random 2-layer Llama), built-in names or HF folders")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed repetitions; the best is kept (with --lora-ranks: the median)")  # fmt: skip
    parser.add_argument("--lora-ranks", type=int, nargs="+", default=None,
                        help="compare the full push with these ranks' adapter pushes instead (e.g. 16 64)")  # fmt: skip
    parser.add_argument("--output", default=None,
                        help="JSON path (default benchmarks/results/weight_sync.json, or weight_sync_lora.json)")  # fmt: skip
    args = parser.parse_args()
    results = Path(__file__).parent / "results"
    if args.lora_ranks:
        lora_main(args, Path(args.output or results / "weight_sync_lora.json"))
        return
    args.output = args.output or str(results / "weight_sync.json")

    from flashrl.models import build_tiny_llama, resolve_model

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.models:
            if spec == "tiny":
                path = str(build_tiny_llama(Path(tmp) / "tiny"))
                sizes = [256 * 1024, 4 * MIB]
            else:
                path = resolve_model(spec)
                sizes = [16 * MIB, 128 * MIB]
            rows += measure(spec, path, sizes, args.repeats)
    print(table(rows))
    result = {"machine": {"platform": platform.platform(), "torch": torch.__version__}, "repeats": args.repeats,
              "rows": rows, "table": table(rows)}  # fmt: skip
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


def lora_main(args: argparse.Namespace, out: Path) -> None:
    from flashrl.models import build_tiny_llama, resolve_model

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.models:
            path = str(build_tiny_llama(Path(tmp) / "tiny")) if spec == "tiny" else resolve_model(spec)
            rows += measure_lora(spec, path, args.lora_ranks, args.repeats)
    print(lora_table(rows))
    result = {"machine": {"platform": platform.platform(), "torch": torch.__version__, "cpus": os.cpu_count()},
              "repeats": args.repeats, "statistic": "median", "rows": rows, "table": lora_table(rows)}  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
