"""FlashREINFORCE on Qwen2.5-7B-Instruct in ALFWorld: long multi-turn text-household episodes.

    python tuned_examples/alfworld_qwen25_7b.py --dry-run
    python tuned_examples/alfworld_qwen25_7b.py --alfworld-data $ALFWORLD_DATA/json_2.1.1

With --alfworld-data (the official data, `alfworld-download`), training plays `train/` and evaluation
`valid_unseen/`; without it, flashrl's offline generator writes ALFWorld-format games of all six task
types (same engine, same grammar; not the official scenes). Episodes end on success or after 50 turns.
Pinned: vllm==0.32.0, torch==2.13.0, transformers>=5.16.1,<5.20, ray==2.60.0, alfworld==0.4.2.
"""

import argparse
import os
import sys

from flashrl.algorithms import FlashReinforceConfig
from flashrl.recipes import GPU_PINS, NodePlan, Preset, run_preset

PRESET = Preset(
    name="alfworld_qwen25_7b",
    description="Qwen2.5-7B-Instruct, ALFWorld (6 task types, up to 50 turns), on one 8-GPU node",
    success_metric="evaluation/episode_return_mean",
    success_threshold=0.80,
    stop_iters=300,
    node_plan=NodePlan(
        num_nodes=1, gpus_per_node=8, cpus_per_node=96, gpu_memory_gib=80, host_memory_gib=1024
    ),
    pins={**GPU_PINS, "alfworld": "==0.4.2"},
    sources={
        "lr=1e-6, temperature=1.0, max_new_tokens=512, max_turns=50": "verl-agent's GiGPO ALFWorld recipe "
        "for Qwen2.5-7B-Instruct (Feng et al., 2025)",
        "train_batch_size=128": "ours: 128 games x 1 rollout (GiGPO: 16 games x 8 rollouts)",
        "max_episode_tokens=16384": "ours: the whole history stays in context (GiGPO keeps the last 2 steps)",
        "delta=0.01": "ours",
        "success 0.80 on valid_unseen": "ours (GiGPO reports about 0.9 for this model)",
    },
    notes=(
        "Without --alfworld-data the games are generated offline (ALFWorld format, not the official scenes).",
    ),
    needs_alfworld=True,
    data_args={"ALFWorld data (json_2.1.1)": "alfworld_data"},
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    official = (
        os.path.join(os.environ["ALFWORLD_DATA"], "json_2.1.1") if os.environ.get("ALFWORLD_DATA") else None
    )
    parser.add_argument(
        "--alfworld-data",
        default=official,
        help="official json_2.1.1 folder (default: $ALFWORLD_DATA/json_2.1.1); unset = generated games",
    )
    parser.add_argument(
        "--num-generated-games", type=int, default=1024, help="games to generate without data"
    )


def make_config(args: argparse.Namespace) -> FlashReinforceConfig:
    if args.alfworld_data:
        train = {"games": os.path.join(args.alfworld_data, "train")}
        held_out = {"games": os.path.join(args.alfworld_data, "valid_unseen")}
    else:
        train = {"split": "train", "num_games": args.num_generated_games}
        held_out = {"split": "valid_unseen", "num_games": 134}
    return (
        FlashReinforceConfig()
        .environment("flashrl/ALFWorld-v0", env_config={**train, "max_turns": 50})
        .env_runners(
            num_env_runners=4,
            num_gpus_per_env_runner=1,
            num_cpus_per_env_runner=8,
            engine="vllm",
            engine_options={"dtype": "bfloat16", "gpu_memory_utilization": 0.85},
            episodes_in_flight_per_env_runner=32,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=512,
            max_episode_tokens=16384,
            sample_timeout_s=1800.0,
        )
        .learners(num_learners=4, num_gpus_per_learner=1, num_cpus_per_learner=4)
        .training(
            model="Qwen/Qwen2.5-7B-Instruct",
            dtype="bfloat16",
            lr=1e-6,
            train_batch_size=128,
            delta=0.01,
            grad_clip=1.0,
            gradient_checkpointing=True,
        )
        .evaluation(
            evaluation_interval=25,
            evaluation_num_episodes=134,
            evaluation_temperature=0.0,
            evaluation_env_config=held_out,
        )
        .checkpointing(checkpoint_frequency=50, num_checkpoints_to_keep=3)
    )


if __name__ == "__main__":
    sys.exit(run_preset(PRESET, make_config, add_arguments=add_arguments))
