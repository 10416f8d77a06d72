"""The CPU main job: FlashREINFORCE on SmolLM2-135M-Instruct learning easy sums, on a 2-core laptop.

    python tuned_examples/smollm2_arithmetic_cpu.py                 # about 11 minutes on 2 cores (docs/training.md)
    python tuned_examples/smollm2_arithmetic_cpu.py --dry-run       # the plan, nothing started
    python tuned_examples/smollm2_arithmetic_cpu.py --resume                # continue the newest run from its newest checkpoint
    ray job submit --working-dir . -- python tuned_examples/smollm2_arithmetic_cpu.py --stop-iters 2

Real components end to end: vLLM's CPU build samples (recording the behavior log-prob of every token),
an EnvRunner actor plays `flashrl/Math-v0` ("What is a + b? Answer with just the number.", a and b in
1..30 (the suffix lifts the model's greedy accuracy from about 0.27 to 0.35), reward 1 when the last
number of the reply is a + b, checked by math-verify), the learner recomputes log-probs, applies the
Sequence Trust Region and Sample-Mean Optimization and takes one AdamW step per batch of 16 episodes
from 16 different prompts. Held-out greedy accuracy is measured before and after (64 sums the training
stream never shows: the 900 possible sums are split once into 836 for training and 64 held out).

Writes under --output: TensorBoard logs, progress.jsonl, curves.png, checkpoints/ (every 10 updates or
10 minutes, the newest 2: what --resume continues from), checkpoint_final/ (a Hugging Face folder
transformers and vLLM load), result.json with the before/after accuracy.
"""

import os
import random
import sys

from flashrl.algorithms import FlashReinforceConfig
from flashrl.recipes import CPU_PINS, NodePlan, Preset, run_preset

PRESET = Preset(
    name="smollm2_arithmetic_cpu",
    description="SmolLM2-135M-Instruct, easy sums (a + b, 1..30), vLLM CPU build, 2 CPU cores",
    success_metric="evaluation/episode_return_mean",
    success_threshold=0.55,
    stop_iters=60,
    node_plan=NodePlan(num_nodes=1, gpus_per_node=0, cpus_per_node=os.cpu_count() or 2, host_memory_gib=24),
    pins=CPU_PINS,
    needs_gpu=False,
    sources={
        "train_batch_size=16, max_new_tokens=24, lr=3e-6 (AdamW), temperature=1.0": "ours: a bare "
        "single-process FlashREINFORCE loop on this model took greedy accuracy on 64 held-out sums from "
        "0.47 to 0.72 in 30 updates with these values",
        "delta=0.05": "ours: measured drift here is 5e-4 on average (max 2e-3) at a policy lag of ~2; 0.05 only rejects "
        "trajectories from much older weights",
        "success 0.55 greedy accuracy after 60 updates": "ours: clearly above the starting ~0.3-0.5",
    },
)


def easy_sums(num_held_out: int = 64, seed: int = 1234) -> tuple[list[dict], list[dict]]:
    """All 900 sums a + b (a, b in 1..30), split into training and held-out questions (disjoint)."""
    rows = [
        {"id": f"sum:{a}+{b}", "question": f"What is {a} + {b}? Answer with just the number.", "answer": str(a + b)}
        for a in range(1, 31)
        for b in range(1, 31)
    ]
    random.Random(seed).shuffle(rows)
    return rows[num_held_out:], rows[:num_held_out]


def make_config(args) -> FlashReinforceConfig:
    train, held_out = easy_sums()
    task_fields = {"template": "plain", "id_field": "id"}
    return (
        FlashReinforceConfig()
        .environment("flashrl/Math-v0", env_config={"tasks": train, **task_fields})
        .env_runners(
            num_env_runners=1,
            num_cpus_per_env_runner=1,
            engine="vllm",
            episodes_in_flight_per_env_runner=32,
            temperature=1.0,
            max_new_tokens=24,
            max_episode_tokens=256,
        )
        .learners(num_learners=0)
        .training(
            model="smollm2-135m-instruct",
            dtype="float32",
            lr=3e-6,
            train_batch_size=16,
            delta=0.05,
            grad_clip=1.0,
        )
        .evaluation(
            evaluation_interval=20,
            evaluation_num_episodes=64,
            evaluation_temperature=0.0,
            evaluation_env_config={"tasks": held_out, "order": "sequential", **task_fields},
        )
        .debugging(seed=0)
    )


if __name__ == "__main__":
    sys.exit(run_preset(PRESET, make_config))
