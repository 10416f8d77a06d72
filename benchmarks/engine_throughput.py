"""Engine throughput and weight-update cost, as ratios measured in one run.

1. Generated tokens/s of flashrl's vLLM engine (concurrent ``generate`` calls on the async engine)
   vs raw ``vllm.LLM.generate`` on the same prompts, seeds and sampling settings (goal: >= 0.9).
2. Generated tokens/s of the torch engine vs flashrl's vLLM engine.
3. Time of one in-place weight update of the vLLM engine vs a plain memory copy of the same bytes.

Usage::

    python benchmarks/engine_throughput.py --num-prompts 32 --max-tokens 64
    python benchmarks/engine_throughput.py --model path/to/hf_folder --output out.json

Prints a table and writes JSON (default ``benchmarks/results/engine_throughput.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch

QUESTIONS = [
    "What is {a} + {b}?",
    "Write a short sentence about the number {a}.",
    "List {b} animals.",
    "Explain in one line why {a} is smaller than {c}.",
]


def build_prompts(tokenizer: Any, n: int) -> list[list[int]]:
    prompts = []
    for i in range(n):
        text = QUESTIONS[i % len(QUESTIONS)].format(a=i + 3, b=(i % 5) + 2, c=i + 40)
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        prompts.append(list(ids))
    return prompts


def _engine_options(args: argparse.Namespace) -> Any:
    """The engine options both sides use: a context that fits every prompt and its completion."""
    from flashrl.engines.vllm_engine import VLLMEngineOptions

    return VLLMEngineOptions(max_model_len=1024, max_num_seqs=max(args.num_prompts, 1))


def raw_vllm_tokens_per_s(
    model_path: str, prompts: list[list[int]], args: argparse.Namespace
) -> dict[str, float]:
    """``vllm.LLM.generate`` with the engine settings flashrl uses on this platform."""
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    from flashrl.engines.vllm_engine import cpu_thread_defaults

    on_cpu = current_platform.is_cpu()
    if on_cpu:
        import os

        for key, value in cpu_thread_defaults().items():
            os.environ.setdefault(key, value)
    # The very engine arguments flashrl's engine uses (KV budget in bytes on CPU, same context and
    # sequences), so the ratio measures flashrl's layer, not different vLLM settings.
    from transformers import AutoConfig

    from flashrl.engines.vllm_engine import vllm_engine_args

    engine_args = vllm_engine_args(
        _engine_options(args),
        path=model_path,
        seed=args.seed,
        on_cpu=on_cpu,
        hf_config=AutoConfig.from_pretrained(model_path),
    )
    engine_args.pop("worker_extension_cls")  # weight updates are not measured on the raw engine
    llm = LLM(**engine_args)
    params = [
        SamplingParams(temperature=1.0, max_tokens=args.max_tokens, seed=i, logprobs=0, detokenize=False)
        for i in range(len(prompts))
    ]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(inputs[:2], params[:2], use_tqdm=False)  # warm-up
    best = None
    for _ in range(args.repeats):
        start = time.perf_counter()
        outs = llm.generate(inputs, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        rate = tokens / elapsed
        best = rate if best is None else max(best, rate)
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return {"tokens_per_s": best or 0.0, "tokens": float(tokens)}


def engine_tokens_per_s(
    engine: Any, prompts: list[list[int]], args: argparse.Namespace, loop
) -> dict[str, float]:
    from flashrl.engines import SamplingConfig

    async def run(ps):
        return await asyncio.gather(
            *[
                engine.generate(p, SamplingConfig(max_tokens=args.max_tokens, seed=i))
                for i, p in enumerate(ps)
            ]
        )

    loop.run_until_complete(run(prompts[:2]))  # warm-up
    best = None
    for _ in range(args.repeats):
        start = time.perf_counter()
        comps = loop.run_until_complete(run(prompts))
        elapsed = time.perf_counter() - start
        tokens = sum(len(c.token_ids) for c in comps)
        rate = tokens / elapsed
        best = rate if best is None else max(best, rate)
    return {"tokens_per_s": best or 0.0, "tokens": float(tokens)}


def weight_update_seconds(engine: Any, model_path: str, loop, repeats: int) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).state_dict()
    nbytes = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in state.values()}.values())
    times = []
    for v in range(repeats):
        start = time.perf_counter()
        loop.run_until_complete(engine.update_weights(state, version=v + 1))
        times.append(time.perf_counter() - start)
    buffers = [torch.empty_like(t) for t in state.values()]
    copy_times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for dst, src in zip(buffers, state.values()):
            dst.copy_(src)
        copy_times.append(time.perf_counter() - start)
    return {"update_s": min(times), "memcpy_s": min(copy_times), "bytes": float(nbytes)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument(
        "--model", default="smollm2-135m-instruct", help="model spec (built-in, folder, hub id)"
    )
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="timed repetitions; the best is kept")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-torch", action="store_true", help="skip the torch engine comparison")
    parser.add_argument("--output", default=str(Path(__file__).parent / "results" / "engine_throughput.json"))
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from flashrl.engines import make_engine
    from flashrl.models import resolve_model

    model_path = resolve_model(args.model)
    prompts = build_prompts(AutoTokenizer.from_pretrained(model_path), args.num_prompts)
    loop = asyncio.new_event_loop()

    raw = raw_vllm_tokens_per_s(model_path, prompts, args)
    options = _engine_options(args)
    engine = make_engine("vllm", model_path, seed=args.seed, max_model_len=options.max_model_len,
                         max_num_seqs=options.max_num_seqs)
    try:
        ours = engine_tokens_per_s(engine, prompts, args, loop)
        update = weight_update_seconds(engine, model_path, loop, repeats=3)
    finally:
        engine.close()
    torch_rate = None
    if not args.skip_torch:
        with make_engine("torch", model_path, seed=args.seed) as teng:
            torch_rate = engine_tokens_per_s(teng, prompts, args, loop)

    rows = [
        ("raw vllm.LLM.generate tokens/s", raw["tokens_per_s"], 1.0),
        ("flashrl vllm engine tokens/s", ours["tokens_per_s"], ours["tokens_per_s"] / raw["tokens_per_s"]),
    ]
    if torch_rate:
        rows.append(
            (
                "flashrl torch engine tokens/s",
                torch_rate["tokens_per_s"],
                torch_rate["tokens_per_s"] / ours["tokens_per_s"],
            )
        )
    rows += [
        ("memcpy of the weights (s)", update["memcpy_s"], 1.0),
        ("vllm in-place weight update (s)", update["update_s"], update["update_s"] / update["memcpy_s"]),
    ]
    print(f"\n{args.num_prompts} prompts x up to {args.max_tokens} new tokens, model {args.model}")
    print(f"{'measure':<36}{'value':>12}{'ratio':>10}")
    for name, value, ratio in rows:
        print(f"{name:<36}{value:>12.3f}{ratio:>10.3f}")
    print("ratios: flashrl vllm / raw vllm; torch / flashrl vllm; weight update / memcpy")

    result = {
        "model": args.model,
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        "platform": platform.platform(),
        "torch_threads": torch.get_num_threads(),
        "raw_vllm": raw,
        "flashrl_vllm": ours,
        "flashrl_vs_raw_ratio": ours["tokens_per_s"] / raw["tokens_per_s"],
        "torch_engine": torch_rate,
        "torch_vs_vllm_ratio": torch_rate["tokens_per_s"] / ours["tokens_per_s"] if torch_rate else None,
        "weight_update": update,
        "update_vs_memcpy_ratio": update["update_s"] / update["memcpy_s"],
    }
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
