"""What the agentic CPU job's learner memory is made of: weights, float32 masters, AdamW moments, one update.

The learner of ``tuned_examples/smollm2_python_tool_cpu.py`` (SmolLM2-135M-Instruct, bfloat16 with
float32 masters, AdamW, passes of at most 2048 tokens) is built from that job's own config
(``config.learner_spec``) in a fresh child process, and its resident set size is read after each
stage:

1. ``learner``: the model loaded in bfloat16 plus its float32 master copy (``LocalPolicy``);
2. ``moments``: AdamW's two float32 moments (allocated by one step at learning rate 0 on zero gradients);
3. ``update``: one update of 4 episodes of 512 tokens, its peak above the size before it (gradients,
   the float32 master gradients, activations) and what stays after it. That is one pass of the job's
   largest size (``max_tokens_per_micro_batch=2048``): the job's 16 episodes run in passes of at most
   that size one after another, whose activations are freed between them, so its peak is one such
   pass's plus the gradients (a full batch of 16 takes over 15 minutes on two loaded cores).

Each stage's exact tensor bytes (parameters x element size) sit beside the measured growth, and the
dry-run's estimate (``flashrl.plan.plan_run``'s ``learner_memory``) beside both. Peak RSS is reset with
``/proc/self/clear_refs`` and glibc's mmap threshold is fixed low (as ``benchmarks/learner_memory.py``),
so memory freed by one stage cannot hide the next one's.

    python benchmarks/tool_learner_memory.py          # writes benchmarks/results/tool_learner_memory.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _reports import write_json

EXAMPLE = Path(__file__).resolve().parents[1] / "tuned_examples" / "smollm2_python_tool_cpu.py"


def tool_job_config():
    """The tool job's config as its command line builds it with no flags."""
    import importlib.util

    from flashrl.recipes.run import build_config

    spec = importlib.util.spec_from_file_location("_tool_job", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config, _ = build_config(module.PRESET, module.make_config, ["--output", "unused"])
    return config


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def measure_stages(batch_size: int, length: int) -> dict:
    """The child's work: build the job's learner stage by stage, reading the RSS after each."""
    import torch
    from learner_memory import (
        _allocate_optimizer_state,
        _current_rss,
        _peak_rss,
        _reset_peak_rss,
        make_batch,
    )

    from flashrl.learners import Learner
    from flashrl.models import resolve_model

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    config = tool_job_config()
    spec = config.learner_spec(model=resolve_model(config.model), train_size=None)
    stages: dict[str, dict] = {}
    before = _current_rss()
    learner = Learner(spec)
    policy = learner.policy
    model_bytes = _tensor_bytes(policy.model.parameters())
    master_bytes = 0 if policy.master_model is policy.model else _tensor_bytes(policy.master_model.parameters())
    stages["learner"] = {"rss_growth_bytes": _current_rss() - before, "weights_bytes": model_bytes,
                         "float32_master_bytes": master_bytes}
    before = _current_rss()
    _allocate_optimizer_state(learner)
    moments = [t for state in learner.optimizer.state.values() for t in state.values()
               if torch.is_tensor(t) and t.dim() > 0]
    stages["moments"] = {"rss_growth_bytes": _current_rss() - before, "moment_bytes": _tensor_bytes(moments)}
    batch = make_batch(batch_size, length, policy.model.config.vocab_size, seed=2)
    before = _current_rss()
    _reset_peak_rss()
    start = time.perf_counter()
    metrics = learner.update(batch)
    stages["update"] = {
        "peak_above_before_bytes": _peak_rss() - before,
        "rss_growth_after_bytes": _current_rss() - before,
        "bfloat16_gradient_bytes": model_bytes,
        "float32_master_gradient_bytes": master_bytes,
        "seconds": time.perf_counter() - start,
        "num_micro_batches": metrics["num_micro_batches"],
    }
    return {"stages": stages, "final_rss_bytes": _current_rss()}


def _child(queue, *args) -> None:
    try:
        queue.put(measure_stages(*args))
    except Exception as exc:  # noqa: BLE001 - reported in the output (e.g. out of memory)
        queue.put({"error": f"{type(exc).__name__}: {exc}"})


def estimate(length: int) -> dict:
    """The dry run's parts for the same learner (the job's max_episode_tokens is its context budget)."""
    from flashrl.plan import plan_run

    config = tool_job_config()
    lm = plan_run(config).learner_memory
    return {"weights": lm.weights, "gradients": lm.gradients, "master": lm.master, "optimizer": lm.optimizer,
            "activations": lm.activations, "total": lm.total, "max_episode_tokens": config.max_episode_tokens,
            "measured_length": length}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--batch-size", type=int, default=4, help="episodes per update (the job's B is 16)")
    parser.add_argument("--length", type=int, default=512, help="tokens per episode (the job's longest: about 520)")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/tool_learner_memory.json"))
    args = parser.parse_args(argv)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", "65536")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(queue, args.batch_size, args.length))
    proc.start()
    proc.join()
    measured = queue.get() if not queue.empty() else {"error": f"child exited with {proc.exitcode}"}
    import torch

    result = {
        "benchmark": "tool_learner_memory",
        "job": "tuned_examples/smollm2_python_tool_cpu.py",
        "config": {"batch_size": args.batch_size, "length": args.length},
        "measured": measured,
        "estimate": estimate(args.length),
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "cpus": os.cpu_count()},
    }
    print(json.dumps(result, indent=2))
    write_json(args.output, result)
    return result


if __name__ == "__main__":
    main()
