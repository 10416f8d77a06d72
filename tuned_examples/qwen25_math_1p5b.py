"""FlashREINFORCE on Qwen2.5-Math-1.5B: R1-Zero-style math reasoning (MATH questions, verified answers).

    python tuned_examples/qwen25_math_1p5b.py --dry-run
    python tuned_examples/qwen25_math_1p5b.py --data data/math/train.jsonl --eval-data data/math/math500.jsonl

Data: JSONL/Parquet rows with "question" and "answer" fields (docs/training.md, "Data preparation").
Success: greedy accuracy on the held-out file. Pinned: vllm==0.32.0, torch==2.13.0,
transformers>=5.16.1,<5.20, ray==2.60.0 (GPU_PINS).
"""

import argparse
import sys

from flashrl.algorithms import FlashReinforceConfig
from flashrl.recipes import GPU_PINS, NodePlan, Preset, run_preset

PRESET = Preset(
    name="qwen25_math_1p5b",
    description="Qwen2.5-Math-1.5B, single-turn math (MATH-style questions), on one 8-GPU node",
    success_metric="evaluation/episode_return_mean",
    success_threshold=0.70,
    stop_iters=500,
    node_plan=NodePlan(
        num_nodes=1, gpus_per_node=8, cpus_per_node=96, gpu_memory_gib=80, host_memory_gib=1024
    ),
    pins=GPU_PINS,
    sources={
        "lr=1e-6, temperature=1.0, max_new_tokens=3000": "Dr. GRPO, 'Understanding R1-Zero-Like Training' "
        "(Liu et al., 2025), recipe for Qwen2.5-Math-1.5B",
        "max_episode_tokens=4096": "the model's max_position_embeddings",
        "train_batch_size=128": "ours: 128 prompts x 1 rollout (the anchor: 128 prompts x 8 rollouts)",
        "delta=0.01": "ours (the config default); sweep it with tune_delta_batch_sweep.py",
        "success 0.70 greedy on MATH-500": "ours: below what R1-Zero-style recipes report for this model",
    },
    notes=("Qwen2.5-Math-1.5B has a 4096-token context: prompt + answer must fit in max_episode_tokens.",),
    data_args={"training data": "data", "held-out data": "eval_data"},
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", default="data/math/train.jsonl", help="training questions (JSONL/Parquet)")
    parser.add_argument("--eval-data", default="data/math/math500.jsonl", help="held-out questions")


def make_config(args: argparse.Namespace) -> FlashReinforceConfig:
    return (
        FlashReinforceConfig()
        .environment("flashrl/Math-v0", env_config={"tasks": args.data, "template": "boxed"})
        .env_runners(
            num_env_runners=4,
            num_gpus_per_env_runner=1,
            num_cpus_per_env_runner=4,
            engine="vllm",
            engine_options={"dtype": "bfloat16", "gpu_memory_utilization": 0.85},
            episodes_in_flight_per_env_runner=64,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=3000,
            max_episode_tokens=4096,
        )
        .learners(num_learners=4, num_gpus_per_learner=1, num_cpus_per_learner=4)
        .training(
            model="Qwen/Qwen2.5-Math-1.5B",
            dtype="bfloat16",
            lr=1e-6,
            train_batch_size=128,
            delta=0.01,
            grad_clip=1.0,
            weight_decay=0.0,
            gradient_checkpointing=True,
        )
        .evaluation(
            evaluation_interval=50,
            evaluation_num_episodes=500,
            evaluation_temperature=0.0,
            evaluation_env_config={"tasks": args.eval_data},
        )
        .checkpointing(checkpoint_frequency=100)
    )


if __name__ == "__main__":
    sys.exit(run_preset(PRESET, make_config, add_arguments=add_arguments))
