"""A callback and a custom metric: the length of the model's replies and its answer rate, and a stop rule.

`ReplyStats.on_episode_end` runs in each EnvRunner actor, once per finished training episode, and
logs two values to the runner's metrics logger; flashrl sends them with the runner's episodes and
reduces them once per iteration into the result as ``callbacks/reply_tokens_mean`` (mean),
``callbacks/reply_tokens_max`` (max) and ``callbacks/answer_rate`` (mean). `on_train_result` runs in
this process after each iteration and stops the run once the answer rate reaches ``--stop-answer-rate``.

    python examples/extending/callback_metric.py                      # SmolLM2-135M, torch engine, CPU
    python examples/extending/callback_metric.py --iterations 2 --stop-answer-rate 0.5
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from flashrl.algorithms import FlashReinforceConfig
from flashrl.callbacks import FlashReinforceCallbacks


class ReplyStats(FlashReinforceCallbacks):
    stop_answer_rate = 1.0
    """Stop once `callbacks/answer_rate` reaches this (a class attribute: it travels with the class)."""

    def on_episode_end(self, *, episode, metrics_logger, is_evaluation, **kwargs):  # in an EnvRunner
        if is_evaluation:
            return
        metrics_logger.log_value("reply_tokens_mean", episode.num_generated_tokens, reduce="mean")
        metrics_logger.log_value("reply_tokens_max", episode.num_generated_tokens, reduce="max")
        # flashrl/Math-v0 puts the answer it read from the reply in info["extracted"] (None: no answer).
        metrics_logger.log_value("answer_rate", episode.info.get("extracted") is not None, reduce="mean")

    def on_train_result(self, *, result, **kwargs):  # in the algorithm's process
        if result.get("callbacks/answer_rate", 0.0) >= self.stop_answer_rate:
            result["should_stop"] = True


def make_config(args: argparse.Namespace) -> FlashReinforceConfig:
    ReplyStats.stop_answer_rate = args.stop_answer_rate
    return (
        FlashReinforceConfig()
        .environment("flashrl/Math-v0", env_config={"preset": "easy_sums"})
        .env_runners(num_env_runners=1, num_cpus_per_env_runner=0.5, engine="torch",
                     episodes_in_flight_per_env_runner=4, max_new_tokens=16, max_episode_tokens=256)
        .learners(num_learners=0)
        .training(model=args.model, train_batch_size=args.batch_size, lr=1e-5)
        .reporting(tensorboard=False, console_every=0)
        .resources(num_cpus_for_main_process=0.25)
        .callbacks(ReplyStats)
    )


def run(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Train until `--iterations` or the callback's stop; returns each iteration's result."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="built-in name, hub id or folder")
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--stop-answer-rate", type=float, default=1.0)
    args = parser.parse_args(argv)
    algo = make_config(args).build_algo()
    results = []
    try:
        for _ in range(args.iterations):
            result = algo.train()
            results.append(result)
            print(
                f"iteration {result['training_iteration']}: reply tokens mean "
                f"{result['callbacks/reply_tokens_mean']:.2f}, max {result['callbacks/reply_tokens_max']:.0f}, "
                f"answer rate {result['callbacks/answer_rate']:.2f}",
                flush=True,
            )
            if result.get("should_stop"):
                print(f"answer rate >= {args.stop_answer_rate}: the callback stopped the run.")
                break
    finally:
        algo.stop()
    return results


if __name__ == "__main__":
    run(sys.argv[1:])
