"""`FlashReinforce`: the algorithm driver, a Ray Tune `Trainable`.

One `train()` call is one iteration of the method (docs/design.md §1, §3)::

    episodes = stream.next_batch(version)    # next B finished episodes, B distinct prompts, as they arrive
    metrics  = learner_group.update(TrainBatch.from_episodes(episodes))     # exactly one optimizer step
    weight_sync.push(learner_group, env_runner_group)                       # runners keep sampling

The EnvRunners play episodes the whole time; the learner only waits when fewer than B finished
episodes are buffered (`learners/idle_fraction`). The episode stream (`flashrl.env_runners.stream`)
owns the batches, the admission budget and staleness bound, the books and the evaluation protocol;
`flashrl.metrics.IterationMetrics` builds each iteration's metrics. `rollout_mode="sync_group"` is
the GRPO-style comparison: B/G prompts x G rollouts, wait for all, a group-mean baseline, weights
loaded before the next round.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from typing import Any

from ray.tune import Trainable
from ray.tune.execution.placement_groups import PlacementGroupFactory

from flashrl.algorithms.flash_reinforce.config import FlashReinforceConfig
from flashrl.checkpoints import read_checkpoint, read_config, write_checkpoint
from flashrl.env_runners import EnvRunnerGroup, EpisodeStream, RunnerReport
from flashrl.episode import Episode
from flashrl.metrics import (
    IterationMetrics,
    IterationTimes,
    TensorBoardLogger,
    iteration_histograms,
    policy_lags,
    progress_line,
)
from flashrl.weight_sync.layout import TransferLayout, planned_engine_options
from flashrl.weight_sync.route import route_for

logger = logging.getLogger("flashrl")


class FlashReinforce(Trainable):
    """FlashREINFORCE on Ray: EnvRunner actors stream episodes, a learner group takes one step per batch.

    Build it from a config (`config.build_algo()`), or let Ray Tune build it from
    `param_space=config` (a dict of the config's fields, grid searches allowed).
    """

    def __init__(self, config: FlashReinforceConfig | dict[str, Any] | None = None, **kwargs: Any) -> None:
        if isinstance(config, FlashReinforceConfig):
            config = config.to_dict()
        super().__init__(config=dict(config or {}), **kwargs)

    # ------------------------------------------------------------------------------------------
    # Tune hooks
    # ------------------------------------------------------------------------------------------
    @classmethod
    def default_resource_request(cls, config: dict[str, Any] | FlashReinforceConfig) -> PlacementGroupFactory:
        """One bundle for this process (and a local learner), one per learner, one per env runner."""
        algo_config = _as_config(config)
        return PlacementGroupFactory(algo_config.resource_bundles(), strategy="PACK")

    def setup(self, config: dict[str, Any]) -> None:
        from flashrl.learners import LearnerGroup
        from flashrl.models import resolve_model
        from flashrl.ray_utils import check_resources, init_or_join

        self.algo_config = _as_config(config)
        self.algo_config.validate()
        logging.getLogger("flashrl").setLevel(self.algo_config.log_level)
        cfg = self.algo_config
        # Deterministic errors fail here, in seconds, before Ray or any engine starts: the model name,
        # and one env built and reset with every env config the run will use.
        self.model_path = resolve_model(cfg.model)
        _check_envs(cfg)
        init_or_join()
        check_resources(self.algo_config)
        # Every LearnerSpec field the config also has, by name; the loss is the config's FlashReinforceLoss.
        spec = cfg.learner_spec(model=self.model_path)
        self.stream: EpisodeStream | None = None
        self.learner_group = LearnerGroup(
            spec,
            num_learners=max(1, cfg.num_learners),
            num_cpus_per_learner=cfg.num_cpus_per_learner,
            num_gpus_per_learner=cfg.num_gpus_per_learner,
            local=cfg.num_learners == 0,
        )
        self.stream = EpisodeStream(
            EnvRunnerGroup(
                cfg.env_runner_spec(engine_options=_planned_engine_options(cfg)), model_path=self.model_path
            ),
            rollout_mode=cfg.rollout_mode,
            group_size=cfg.group_size,
            evaluation_num_samples_per_prompt=cfg.evaluation_num_samples_per_prompt,
            evaluation_interval=cfg.evaluation_interval,
            evaluation_at_start=cfg.evaluation_at_start,
        )
        facts = self.env_runner_group.setup()
        self.pad_token_id = int(facts["pad_token_id"])
        # The route the runners' engines resolved (shm, or a GPU push route formed here, so that a
        # rendezvous failure surfaces at setup); sync_group waits for every runner to load.
        layout = TransferLayout.of(self.learner_group.transfer_devices(), self.env_runner_group.transfer_devices)
        self._weight_sync = route_for(facts, wait_for_load=cfg.rollout_mode == "sync_group", layout=layout)
        self._weight_sync.setup(self.learner_group, self.env_runner_group)
        self.iteration_metrics = IterationMetrics(
            smoothing_window=cfg.metrics_num_episodes_for_smoothing, max_lag=cfg.async_queue_size
        )
        self._tensorboard: TensorBoardLogger | None = None
        if cfg.tensorboard:
            self._tensorboard = TensorBoardLogger(cfg.log_dir or os.path.join(self.logdir, "tensorboard"))

    @property
    def env_runner_group(self) -> EnvRunnerGroup | None:
        """The env runners (the stream's: a restore replaces them)."""
        return self.stream.group if getattr(self, "stream", None) is not None else None

    @property
    def last_evaluation(self) -> dict[str | None, list[RunnerReport]]:
        """The reports of the latest `evaluate()`, per split (what was scored, episode by episode)."""
        return self.stream.last_evaluation

    def step(self) -> dict[str, Any]:
        """One iteration: collect a batch, one learner update, send the new weights."""
        at_start = self._evaluate_at_start()
        start = time.perf_counter()
        version_before = self.learner_group.version
        collected = self.stream.next_batch(version_before)
        episodes = collected.episodes
        from flashrl.learners import TrainBatch

        lags = policy_lags(version_before, [ep.min_policy_version for ep in episodes])
        batch = TrainBatch.from_episodes(
            episodes, pad_token_id=self.pad_token_id, group_ids=collected.group_ids
        )
        update_start = time.perf_counter()
        learner_metrics = self.learner_group.update(batch)
        update_s = time.perf_counter() - update_start
        del batch  # one update, then the batch is gone
        sync_s = 0.0
        if self.learner_group.version != version_before:  # a skipped batch leaves nothing new to send
            sync_s = self._weight_sync.push(self.learner_group, self.env_runner_group)
        times = IterationTimes(
            sample_wait=collected.wait_s,
            learner_update=update_s,
            weight_sync=sync_s,
            iteration=time.perf_counter() - start,
        )
        metrics = self.iteration_metrics.update(
            episodes,
            lags=lags,
            generated_tokens=collected.generated_tokens,
            counts=self.stream.counts(),
            learner_version=self.learner_group.version,
            learner_metrics=learner_metrics,
            times=times,
        )
        metrics.update(at_start)
        if self.stream.evaluation_due(self.iteration + 1):
            metrics.update(self.evaluate())  # after the update: the policy of version iteration + 1
        self._report(metrics, episodes, lags, learner_metrics)
        return metrics

    def _evaluate_at_start(self) -> dict[str, float]:
        """`evaluation_at_start`: evaluate the initial policy once, before the first update of a fresh run.

        As in Molt (`eval.eval_at_start`), a resumed run does not evaluate again. The result goes to
        TensorBoard at step 0 and into the first iteration's result, where an evaluation after that
        iteration's update (`evaluation_interval=1`) overrides it (`evaluation/learner_version` says
        which policy a result scored).
        """
        metrics = self.stream.evaluate_at_start(self.iteration, self.learner_group.version)
        if metrics and self._tensorboard is not None:
            self._tensorboard.log(0, metrics)
        return metrics

    def save_checkpoint(self, checkpoint_dir: str) -> None:
        self.save_to_path(checkpoint_dir)

    def load_checkpoint(self, checkpoint: str | dict[str, Any]) -> None:
        if isinstance(checkpoint, dict):
            raise TypeError("FlashReinforce checkpoints are folders; got a dict.")
        self.restore_from_path(checkpoint)

    def cleanup(self) -> None:
        if getattr(self, "_weight_sync", None) is not None:
            try:
                self._weight_sync.stop()
            except Exception:  # the groups are torn down below either way
                logger.warning("tearing down the weight-transfer group failed", exc_info=True)
            self._weight_sync = None
        if getattr(self, "stream", None) is not None:
            self.stream.stop()
            self.stream = None
        if getattr(self, "learner_group", None) is not None:
            self.learner_group.shutdown()
            self.learner_group = None
        if getattr(self, "_tensorboard", None) is not None:
            self._tensorboard.close()
            self._tensorboard = None

    # ------------------------------------------------------------------------------------------
    # evaluation and reporting
    # ------------------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Evaluate the current policy on every evaluation split (same prompts every time).

        Per split, `evaluation_num_episodes` prompts (at most every task of a finite list once), each
        played `evaluation_num_samples_per_prompt` times at `evaluation_temperature` /
        `evaluation_top_p`; metrics as `flashrl.env_runners.evaluation` describes (`avg@k`, `pass@k`,
        per split and per benchmark). `flashrl eval` runs the same protocol on an in-process runner.
        """
        return self.stream.evaluate(self.learner_group.version)

    def _report(
        self, metrics: dict[str, Any], episodes: list[Episode], lags: list[int], learner_metrics: dict[str, Any]
    ) -> None:
        """TensorBoard, the console line and the periodic checkpoint of the iteration just done."""
        cfg = self.algo_config
        iteration = self.iteration + 1
        if self._tensorboard is not None:
            self._tensorboard.log(iteration, metrics, iteration_histograms(episodes, lags, learner_metrics))
        if cfg.console_every and iteration % cfg.console_every == 0:
            print(progress_line(iteration, metrics), flush=True)
        if cfg.checkpoint_frequency and iteration % cfg.checkpoint_frequency == 0:
            self._periodic_checkpoint(iteration)

    def _periodic_checkpoint(self, iteration: int) -> None:
        cfg = self.algo_config
        folder = cfg.checkpoint_dir or os.path.join(self.logdir, "checkpoints")
        # Inside step(): Tune counts this iteration only when step() returns, so it is passed on.
        self._save(os.path.join(folder, f"checkpoint_{iteration:06d}"), iterations_done=iteration)
        if cfg.num_checkpoints_to_keep:
            found = sorted(d for d in os.listdir(folder) if d.startswith("checkpoint_"))
            for old in found[: -cfg.num_checkpoints_to_keep]:
                shutil.rmtree(os.path.join(folder, old), ignore_errors=True)

    # ------------------------------------------------------------------------------------------
    # checkpoints
    # ------------------------------------------------------------------------------------------
    def save_to_path(self, path: str | os.PathLike[str] | None = None) -> str:
        """Write a checkpoint folder (policy as an HF folder, optimizer, RNG, data cursor, config)."""
        if path is None:
            path = os.path.join(self.logdir, f"checkpoint_{self.iteration:06d}")
        return self._save(path, iterations_done=self.iteration)

    def _save(self, path: str | os.PathLike[str], *, iterations_done: int) -> str:
        # sync_cursor, runner_cursors, totals, num_lost_episodes, num_restarts: the stream's books.
        state = {
            "iteration": iterations_done,
            "learner_version": self.learner_group.version,
            **self.stream.state(),
        }
        return write_checkpoint(
            path, config=self.algo_config.to_dict(), learner_group=self.learner_group, algorithm_state=state
        )

    def restore_from_path(self, path: str | os.PathLike[str]) -> None:
        """Load a checkpoint into this algorithm: learner state, weights on every runner, cursors."""
        checkpoint = read_checkpoint(path)
        state = checkpoint.algorithm_state
        self.learner_group.set_state(checkpoint.learner_state)
        # The books and cursors are the checkpoint's; a streaming group is replaced by a fresh one.
        self.stream.set_state(state)
        group = self.env_runner_group
        self._weight_sync.after_restore(self.learner_group, group)  # every runner loads them; waits
        self._iteration = int(state["iteration"])

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike[str], **config_overrides: Any) -> FlashReinforce:
        """A new algorithm built from a checkpoint's config (optionally overridden) and state."""
        from flashrl.ray_utils import init_or_join

        config = FlashReinforceConfig.from_dict(read_config(path)).update_from_dict(config_overrides)
        init_or_join()
        algo = cls(config=config)
        algo.restore_from_path(path)
        return algo

    def stop(self) -> None:
        """Release the actors and the engines (Tune calls this at the end of a trial)."""
        super().stop()


def _planned_engine_options(config: FlashReinforceConfig) -> dict[str, Any]:
    """The engine options the runners start with: ``weight_sync`` resolved from the resource layout."""
    return planned_engine_options(
        config.engine,
        config.engine_options,
        learner_gpus=config.num_gpus_per_learner,
        runner_gpus=config.num_gpus_per_env_runner,
        num_env_runners=config.num_env_runners,
    )


def _check_envs(config: FlashReinforceConfig) -> None:
    """Build and reset one env of each config the run uses (training; evaluation if it evaluates)."""
    from flashrl.env_runners.env_check import build_env_once
    from flashrl.env_runners.evaluation import evaluation_splits

    spec = config.env_runner_spec()
    build_env_once(spec.env, spec.env_config, seed=spec.seed)
    if config.evaluation_interval or config.evaluation_at_start:
        for split, env_config in evaluation_splits(spec).items():
            what = "evaluation_env_config" if split is None else f"evaluation_splits[{split!r}]"
            build_env_once(spec.env, env_config, what=what, seed=spec.seed)


def _as_config(config: dict[str, Any] | FlashReinforceConfig) -> FlashReinforceConfig:
    if isinstance(config, FlashReinforceConfig):
        return config.copy()
    # Tune adds private keys such as "__trial_info__"; they are not part of the config.
    return FlashReinforceConfig.from_dict({k: v for k, v in config.items() if not k.startswith("__")})
