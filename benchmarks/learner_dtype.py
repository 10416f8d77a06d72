"""The learner's update in float32 vs bfloat16 on the tool job's batches: time, and what bf16 costs in agreement.

`tuned_examples/smollm2_python_tool_cpu.py` trains SmolLM2-135M-Instruct on B = 16 episodes of about
360 tokens (a prompt of about 200, two replies and a tool output), in passes of at most 2048 tokens.
On two CPU cores that update is most of an iteration. This benchmark runs `flashrl.learners.Learner.update`
on batches of that shape with `dtype="float32"` and with `dtype="bfloat16"` (bf16 weights for the
forward and backward, float32 master weights and AdamW moments: `flashrl.learners.policies.LocalPolicy`),
in the same invocation, and reports the ratio of their times.

bf16 is not free: the engine samples in float32 (vLLM's CPU build, `flashrl.engines.vllm_engine`), so a
bf16 learner's recomputed log-probs differ from the recorded ones even at policy lag 0, and the Sequence
Trust Region counts that difference as drift. The benchmark measures it on the same tokens: the mean
per-token Bernoulli-KL (the trust region's drift, `flashrl.algorithms.flash_reinforce.components.bernoulli_kl`)
and the mean |delta log-prob| between the float32 model's and the bf16 model's log-probs at the job's
temperature, over the reply tokens, next to the job's `delta`.

The tokens are real text (the job's system prompt, its worked example and questions, cycled to each
episode's length), so the log-probs are those of text the model reads, not of random ids; the
timing does not depend on them. The first update of each dtype is a warm-up and is not counted.

    python benchmarks/learner_dtype.py                 # SmolLM2-135M-Instruct, B = 16, 3 timed updates each
    python benchmarks/learner_dtype.py --quick         # tiny random model: smoke only

Writes `benchmarks/results/learner_dtype.json` (`--quick`: under the system temp folder).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _configs import benchmark_model
from _repo import RESULTS
from _reports import fmt, machine, table, write_json

NAME = "learner_dtype"
DTYPES = ("float32", "bfloat16")
#: The tool job's batch shape as measured in its runs (ours: episodes of 300-420 tokens, about 200 of them the
#: prompt; tuned_examples/smollm2_python_tool_cpu.py sets B = 16 and max_tokens_per_micro_batch = 2048).
FULL = {"model": "smollm2-135m-instruct", "batch_size": 16, "prompt_tokens": 200, "min_tokens": 300,
        "max_tokens": 420, "micro_batch_tokens": 2048, "timed_updates": 3}
QUICK = {"model": "tiny", "batch_size": 4, "prompt_tokens": 16, "min_tokens": 40, "max_tokens": 64,
         "micro_batch_tokens": 128, "timed_updates": 1}
TEMPERATURE = 0.7
"""tuned_examples/smollm2_python_tool_cpu.py's TEMPERATURE: the learner recomputes log-probs at it."""
DELTA = 0.05
"""tuned_examples/smollm2_python_tool_cpu.py's delta (trust-region threshold)."""


def text_tokens(model_path: str) -> list[int]:
    """Token ids of real text: the tool job's system prompt and a few of its questions."""
    from transformers import AutoTokenizer

    from flashrl.envs.tool_tasks import ONE_SHOT_SYSTEM_PROMPT

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    questions = " ".join(f"What is {a} * {b}?" for a, b in ((37, 58), (91, 12), (64, 77), (23, 45)))
    return tokenizer(ONE_SHOT_SYSTEM_PROMPT + "\n" + questions)["input_ids"]


def make_batch(scale: dict[str, Any], model_path: str, seed: int = 0) -> Any:
    """B episodes of the job's shape: `prompt_tokens` outside the loss, the rest trained on."""
    from flashrl.episode import Episode
    from flashrl.learners import TrainBatch

    text = text_tokens(model_path)
    rng = np.random.default_rng(seed)
    episodes = []
    for i in range(scale["batch_size"]):
        n = int(rng.integers(scale["min_tokens"], scale["max_tokens"] + 1))
        start = int(rng.integers(0, len(text)))
        ids = [text[(start + k) % len(text)] for k in range(n)]
        p = scale["prompt_tokens"]
        episodes.append(
            Episode(
                prompt_id=f"p{i}",
                token_ids=ids,
                loss_mask=[False] * p + [True] * (n - p),
                behavior_logprobs=[0.0] * p + [-1.0] * (n - p),  # no trajectory is rejected: delta is huge below
                reward=float(i % 2),
                policy_versions=[0],
                info={},
            )
        )
    return TrainBatch.from_episodes(episodes, pad_token_id=0)


def time_updates(scale: dict[str, Any], model_path: str, dtype: str, batch: Any) -> dict[str, Any]:
    from flashrl.algorithms.flash_reinforce.learner_loss import FlashReinforceLossSpec
    from flashrl.learners import Learner, LearnerSpec

    spec = LearnerSpec(model=model_path, lr=3e-6, grad_clip=1.0, device="cpu", dtype=dtype,
                       max_tokens_per_micro_batch=scale["micro_batch_tokens"], temperature=TEMPERATURE,
                       loss=FlashReinforceLossSpec(delta=1e9))
    learner = Learner(spec)
    learner.update(batch)  # warm-up: allocates AdamW's moments, first-call kernels
    seconds = []
    for _ in range(scale["timed_updates"]):
        start = time.perf_counter()
        learner.update(batch)
        seconds.append(time.perf_counter() - start)
    return {"dtype": dtype, "update_s": seconds, "update_s_mean": float(np.mean(seconds))}


def agreement(model_path: str, batch: Any) -> dict[str, float]:
    """float32 vs bfloat16 log-probs of the same weights and tokens, over the loss tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    from flashrl.algorithms.flash_reinforce.components import bernoulli_kl
    from flashrl.models import compute_token_logprobs

    logprobs = {}
    for dtype in DTYPES:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()
        with torch.no_grad():
            lp, _ = compute_token_logprobs(model, batch.token_ids, batch.attention_mask, temperature=TEMPERATURE,
                                           with_entropy=False)  # [B, T]
        logprobs[dtype] = lp.float()  # [B, T] float32, as the learner compares them
    mask = batch.loss_mask
    reference, low = logprobs["float32"][mask], logprobs["bfloat16"][mask]  # [N]
    kl = bernoulli_kl(reference, low)  # [N]
    per_trajectory = [float(bernoulli_kl(logprobs["float32"][i][mask[i]], logprobs["bfloat16"][i][mask[i]]).mean())
                      for i in range(mask.shape[0])]
    return {
        "tokens": int(mask.sum()),
        "bernoulli_kl_mean": float(kl.mean()),
        "trajectory_drift_max": max(per_trajectory),
        "abs_logprob_diff_mean": float((reference - low).abs().mean()),
        "abs_logprob_diff_max": float((reference - low).abs().max()),
    }


def render(rows: list[dict[str, Any]], agree: dict[str, float]) -> str:
    base = rows[0]["update_s_mean"]
    body = [[r["dtype"], fmt(r["update_s_mean"], ".1f"), fmt(base / r["update_s_mean"], ".2f")] for r in rows]
    lines = [table(["learner dtype", "update s (mean)", "speed-up vs float32"], body), ""]
    lines.append(table(
        ["tokens", "mean Bernoulli-KL (bf16 vs fp32)", "max trajectory drift", "delta", "mean |dlogp|", "max |dlogp|"],
        [[str(agree["tokens"]), fmt(agree["bernoulli_kl_mean"], ".2e"), fmt(agree["trajectory_drift_max"], ".2e"),
          fmt(DELTA, ".2f"), fmt(agree["abs_logprob_diff_mean"], ".2e"), fmt(agree["abs_logprob_diff_max"], ".2e")]],
    ))
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--quick", action="store_true", help="smoke: tiny random model, small batch")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    quick_dir = Path(tempfile.gettempdir()) / "flashrl-bench-quick"
    args.output = args.output or str((quick_dir if args.quick else RESULTS) / f"{NAME}.json")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import torch

    args = parse_args(argv)
    scale = dict(QUICK if args.quick else FULL)
    with tempfile.TemporaryDirectory(prefix="flashrl-bench-") as tmp:
        model_path = benchmark_model(scale["model"], tmp)
        batch = make_batch(scale, model_path)
        rows = [time_updates(scale, model_path, dtype, batch) for dtype in DTYPES]
        agree = agreement(model_path, batch)
    report = {
        "benchmark": NAME,
        "command": ["python", "benchmarks/learner_dtype.py", *(argv if argv is not None else sys.argv[1:])],
        "settings": {"quick": args.quick, "scale": scale, "temperature": TEMPERATURE, "delta": DELTA,
                     "torch_threads": torch.get_num_threads()},
        "batch": {"episodes": int(batch.token_ids.shape[0]), "tokens": int(batch.attention_mask.sum()),
                  "loss_tokens": int(batch.loss_mask.sum())},
        "rows": rows,
        "speedup_bf16": rows[0]["update_s_mean"] / rows[1]["update_s_mean"],
        "agreement": agree,
        "machine": machine(),
    }
    print(render(rows, agree))
    print(f"wrote {write_json(args.output, report)}")
    return report


if __name__ == "__main__":
    main()
