"""The small CPU run every example of this folder trains with (docs/extending.md).

`run(config_edit, argv)` builds a FlashReinforceConfig for a quick run on the CPU (one EnvRunner
with the exact torch engine, the learner in this process, a batch of 4 short episodes), lets the
example change it, trains a few iterations and returns their results. `--model` picks the policy: a
flashrl model name, a hub id or a local folder; by default a tiny random-weight Llama with SmolLM2's
tokenizer, built in a temporary folder in a second (it answers nonsense: use
`--model smollm2-135m-instruct` to see real learning).
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from typing import Any

from flashrl.algorithms import FlashReinforceConfig


def tiny_model() -> str:
    """A tiny random-weight Llama (2 layers, hidden 64) with SmolLM2's tokenizer, in a temporary folder."""
    from flashrl.models import build_tiny_llama, resolve_model

    folder = tempfile.mkdtemp(prefix="flashrl-tiny-")
    return build_tiny_llama(f"{folder}/model", seed=0, tokenizer_source=resolve_model("smollm2-135m-instruct"))


def run(edit: Callable[[FlashReinforceConfig], FlashReinforceConfig], argv: list[str] | None = None,
        ) -> list[dict[str, Any]]:
    """Train ``--iterations`` iterations of ``edit(base config)``; returns each iteration's results."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--model", default=None, help="policy model (default: a tiny random-weight Llama)")
    parser.add_argument("--iterations", type=int, default=2)
    args = parser.parse_args(argv)
    config = (
        FlashReinforceConfig()
        .env_runners(num_env_runners=1, num_cpus_per_env_runner=0.5, engine="torch",
                     episodes_in_flight_per_env_runner=4, max_new_tokens=16, max_episode_tokens=256)
        .learners(num_learners=0)
        .training(model=args.model or tiny_model(), train_batch_size=4, lr=1e-3, delta=1.0)
        .reporting(tensorboard=False, console_every=1)
        .resources(num_cpus_for_main_process=0.25)
    )
    algo = edit(config).build_algo()
    try:
        return [algo.train() for _ in range(args.iterations)]
    finally:
        algo.stop()
