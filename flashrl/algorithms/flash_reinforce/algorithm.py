"""`FlashReinforce`: the algorithm driver, a Ray Tune `Trainable`.

One `train()` call is one iteration of the method (docs/design.md §1, §3)::

    episodes = next B finished episodes, B distinct prompts, as they arrive   # never wait for stragglers
    metrics  = learner_group.update(TrainBatch.from_episodes(episodes))     # exactly one optimizer step
    weight_sync.push(learner_group, env_runner_group)                       # runners keep sampling

The EnvRunners play episodes the whole time; the learner only waits when fewer than B finished
episodes are buffered (`learners/idle_fraction`). `rollout_mode="sync_group"` is the GRPO-style
comparison: B/G prompts x G rollouts, wait for all, a group-mean baseline, weights loaded before the
next round.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections import Counter, deque
from collections.abc import Mapping
from typing import Any

from ray.tune import Trainable
from ray.tune.execution.placement_groups import PlacementGroupFactory

from flashrl.algorithms.flash_reinforce.config import FlashReinforceConfig
from flashrl.checkpoints import read_checkpoint, read_config, write_checkpoint
from flashrl.env_runners import EnvRunnerGroup, EnvRunnerGroupError, RunnerReport
from flashrl.env_runners.batching import BatchAssembler
from flashrl.episode import Episode
from flashrl.metrics import (
    LAG_BUCKETS,
    TensorBoardLogger,
    Window,
    lag_histogram,
    mean,
    policy_lags,
    progress_line,
)
from flashrl.weight_sync.route import route_for

logger = logging.getLogger("flashrl")

TOKEN_RATE_WINDOW = 10
"""Iterations behind `env_runners/generated_tokens_per_s`."""
WAIT_SLICE_S = 5.0
"""Longest single wait on the episode stream (the overall limit is sample_timeout_s)."""


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
        self.env_runner_group: EnvRunnerGroup | None = None
        self.learner_group = LearnerGroup(
            spec,
            num_learners=max(1, cfg.num_learners),
            num_cpus_per_learner=cfg.num_cpus_per_learner,
            num_gpus_per_learner=cfg.num_gpus_per_learner,
            local=cfg.num_learners == 0,
        )
        self.env_runner_group = EnvRunnerGroup(cfg.env_runner_spec(), model_path=self.model_path)
        facts = self.env_runner_group.setup()
        self.pad_token_id = int(facts["pad_token_id"])
        # The route the runners' engines resolved (shm, or a GPU push route formed here, so that a
        # rendezvous failure surfaces at setup); sync_group waits for every runner to load.
        self._weight_sync = route_for(facts, wait_for_load=cfg.rollout_mode == "sync_group")
        self._weight_sync.setup(self.learner_group, self.env_runner_group)
        self._pending: deque[Episode] = deque()
        self.last_evaluation: dict[str | None, list[RunnerReport]] = {}
        """The reports of the latest `evaluate()`, per split (what was scored, episode by episode)."""
        self._cursor = 0  # sync_group: next prompt index
        self._returns = Window(cfg.metrics_num_episodes_for_smoothing)
        self._lengths = Window(cfg.metrics_num_episodes_for_smoothing)
        self._totals: Counter[str] = Counter()
        # (generated tokens, seconds) of recent iterations: an iteration served from already
        # collected episodes receives no runner report, so tokens/s is averaged over a window.
        self._token_rate: deque[tuple[int, float]] = deque(maxlen=TOKEN_RATE_WINDOW)
        self._tensorboard: TensorBoardLogger | None = None
        if cfg.tensorboard:
            self._tensorboard = TensorBoardLogger(cfg.log_dir or os.path.join(self.logdir, "tensorboard"))

    def step(self) -> dict[str, Any]:
        """One iteration: collect a batch, one learner update, broadcast the new weights."""
        cfg = self.algo_config
        at_start = self._evaluate_at_start()
        start = time.perf_counter()
        if cfg.rollout_mode == "async":
            episodes, group_ids, reports, wait_s = self._collect_async()
        else:
            episodes, group_ids, reports, wait_s = self._collect_sync()
        from flashrl.learners import TrainBatch

        version_before = self.learner_group.version
        lags = policy_lags(version_before, [ep.min_policy_version for ep in episodes])
        batch = TrainBatch.from_episodes(episodes, pad_token_id=self.pad_token_id, group_ids=group_ids)
        update_start = time.perf_counter()
        learner_metrics = self.learner_group.update(batch)
        update_s = time.perf_counter() - update_start
        del batch  # one update, then the batch is gone
        sync_s = 0.0
        if self.learner_group.version != version_before:  # a skipped batch leaves nothing new to send
            sync_s = self._weight_sync.push(self.learner_group, self.env_runner_group)
        iteration_s = time.perf_counter() - start
        metrics = self._metrics(episodes, reports, lags, learner_metrics, wait_s, update_s, sync_s, iteration_s)
        metrics.update(at_start)
        if cfg.evaluation_interval and (self.iteration + 1) % cfg.evaluation_interval == 0:
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
        cfg = self.algo_config
        if not cfg.evaluation_at_start or self.iteration != 0 or self.learner_group.version != 0:
            return {}
        if getattr(self, "_evaluated_at_start", False):
            return {}
        self._evaluated_at_start = True
        metrics = self.evaluate()
        if self._tensorboard is not None:
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
        if getattr(self, "env_runner_group", None) is not None:
            self.env_runner_group.stop()
            self.env_runner_group = None
        if getattr(self, "learner_group", None) is not None:
            self.learner_group.shutdown()
            self.learner_group = None
        if getattr(self, "_tensorboard", None) is not None:
            self._tensorboard.close()
            self._tensorboard = None

    # ------------------------------------------------------------------------------------------
    # batches
    # ------------------------------------------------------------------------------------------
    def _collect_async(self) -> tuple[list[Episode], None, list[RunnerReport], float]:
        """The next B finished episodes of B distinct prompts, in arrival order (`BatchAssembler`).

        Episodes that cannot join the batch wait in `_pending` (bounded; the oldest beyond it is
        dropped and counted). With `async_queue_size` set, stale episodes are dropped and counted,
        and the runners start new episodes only as the admission budget allows (`_allowed_starts`).
        `sample_timeout_s` counts from the last time the batch grew: episodes that keep arriving
        without filling it (too few distinct prompts) are not progress.
        """
        cfg = self.algo_config
        group = self.env_runner_group
        assembler = BatchAssembler(
            cfg.train_batch_size,
            pending_capacity=self._pending_capacity,
            learner_version=self.learner_group.version,
            max_lag=cfg.async_queue_size,
        )
        reports: list[RunnerReport] = []
        wait_start = time.perf_counter()
        try:
            pending, self._pending = self._pending, deque()
            assembler.offer_all(pending)
            self._book_skipped(assembler.take_skipped())
            if not group.streaming:
                group.start_streaming(self._allowed_starts(assembler.blocked()))
            else:
                group.grant(self._allowed_starts(assembler.blocked()))
            last_growth, arrived, stale, repeated = wait_start, 0, 0, assembler.repeated
            while not assembler.full:
                new = group.next_reports(timeout_s=WAIT_SLICE_S)
                reports.extend(new)
                size = len(assembler.batch)
                for report in new:
                    self._book_skipped(report.skipped)  # now: the admission budget counts them
                    arrived += len(report.episodes)
                    assembler.offer_all(report.episodes)
                skipped = assembler.take_skipped()
                stale += skipped["stale"]
                self._book_skipped(skipped)
                group.grant(self._allowed_starts(assembler.blocked()))
                now = time.perf_counter()
                if len(assembler.batch) > size:
                    last_growth, arrived, stale, repeated = now, 0, 0, assembler.repeated
                elif now - last_growth > cfg.sample_timeout_s:
                    raise self._stalled(assembler, arrived, assembler.repeated - repeated, stale)
        except BaseException:
            # Kept on the books: nothing is dropped silently.
            self._pending = deque([*assembler.batch, *assembler.later])
            raise
        wait_s = time.perf_counter() - wait_start
        self._pending = assembler.later
        # The budget the next batch may use is granted now, so the runners sample during the update.
        group.grant(self._allowed_starts(assembler.blocked(set()), consumed=len(assembler.batch)))
        return assembler.batch, None, reports, wait_s

    @property
    def _pending_capacity(self) -> int:
        """Most episodes `_pending` holds: one poll of every runner can overflow a batch by N x B."""
        cfg = self.algo_config
        return (cfg.num_env_runners + 1) * cfg.train_batch_size

    def _allowed_starts(self, blocked: int, consumed: int = 0) -> int | None:
        """Training episodes the runners may have started in total under `async_queue_size` (Q).

        Molt's meaning of `train.async_queue_size`: the rollout side may run at most Q batches ahead of
        the learner. Per episode: started, not yet taken by the learner, not dropped and not lost
        (in flight, buffered, in the batch being collected, waiting in `_pending`) stays <= Q x B.
        The `blocked` waiting episodes (their prompt is already in the batch) do not count, so too
        few distinct finished episodes never deadlock the stream.
        """
        cfg = self.algo_config
        if cfg.async_queue_size is None:
            return None
        trained = self._totals["episodes"] + consumed
        skipped = sum(v for k, v in self._totals.items() if k.startswith("skipped/"))
        settled = trained + skipped + self.env_runner_group.num_lost_episodes + blocked
        return settled + cfg.async_queue_size * cfg.train_batch_size

    def _book_skipped(self, skipped: Mapping[str, int]) -> None:
        self._totals.update({f"skipped/{k}": v for k, v in skipped.items()})

    def _stalled(self, assembler: BatchAssembler, arrived: int, repeated: int, stale: int) -> EnvRunnerGroupError:
        cfg = self.algo_config
        b = cfg.train_batch_size
        collected = len(assembler.batch)
        if not arrived:
            return EnvRunnerGroupError(
                f"No finished episode arrived for {cfg.sample_timeout_s:g} s (sample_timeout_s); "
                f"{collected}/{b} collected, {self.env_runner_group.in_flight} in "
                f"flight. Raise sample_timeout_s for slow environments, or lower max_new_tokens."
            )
        what = (
            f"The batch has not grown for {cfg.sample_timeout_s:g} s (sample_timeout_s): {arrived} episodes "
            f"arrived meanwhile, but {repeated} repeated one of the {len(assembler.prompts)} prompts already "
            f"in the batch and {stale} were stale (async_queue_size={cfg.async_queue_size}); "
            f"{collected}/{b} collected."
        )
        if stale > repeated:
            return EnvRunnerGroupError(
                f"{what} Expected episodes at most async_queue_size versions behind the learner: the "
                f"runners sample with old weights. Fix: raise async_queue_size (or None), or check that "
                f"the runners load new weights (env_runners/num_restarts_lifetime, the runner logs)."
            )
        return EnvRunnerGroupError(
            f"{what} Expected at least train_batch_size={b} distinct prompts: the env has fewer distinct "
            f"prompts than train_batch_size. Fix: lower train_batch_size to the number of distinct tasks "
            f"or fewer, or give the env more tasks."
        )

    def _collect_sync(self) -> tuple[list[Episode], list[int], list[RunnerReport], float]:
        """B/G prompts x G rollouts, waiting for all of them (the comparison baseline)."""
        cfg = self.algo_config
        prompts = cfg.prompts_per_batch
        indices = list(range(self._cursor, self._cursor + prompts))
        self._cursor += prompts
        start = time.perf_counter()
        reports = self.env_runner_group.sample(indices, group_size=cfg.group_size)
        wait_s = time.perf_counter() - start
        for report in reports:
            self._book_skipped(report.skipped)
        episodes = [ep for report in reports for ep in report.episodes]
        episodes.sort(key=lambda ep: (ep.info["episode_index"], ep.info["replica"]))
        if not episodes:
            raise EnvRunnerGroupError(
                f"Every one of the {prompts * cfg.group_size} episodes of this round was dropped "
                f"(see env_runners/num_skipped/*); check the environment and max_episode_tokens."
            )
        group_ids = [int(ep.info["episode_index"]) for ep in episodes]
        return episodes, group_ids, reports, wait_s

    # ------------------------------------------------------------------------------------------
    # evaluation
    # ------------------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Evaluate the current policy on every evaluation split (same prompts every time).

        Per split, `evaluation_num_episodes` prompts (at most every task of a finite list once), each
        played `evaluation_num_samples_per_prompt` times at `evaluation_temperature` /
        `evaluation_top_p`; metrics as `flashrl.env_runners.evaluation` describes (`avg@k`, `pass@k`,
        per split and per benchmark). `flashrl eval` runs the same protocol on an in-process runner.
        """
        from flashrl.env_runners.evaluation import evaluation_metrics, evaluation_splits, num_prompts

        cfg = self.algo_config
        group = self.env_runner_group
        start = time.perf_counter()
        results = {}
        for split in evaluation_splits(group.spec):
            n = num_prompts(group.spec, group.evaluation_size(split))
            results[split] = group.sample(
                list(range(n)), group_size=cfg.evaluation_num_samples_per_prompt, evaluation=True, split=split
            )
        self.last_evaluation = results
        metrics = evaluation_metrics(
            results, num_samples=cfg.evaluation_num_samples_per_prompt, datasource_key=cfg.evaluation_datasource_key
        )
        metrics["evaluation/learner_version"] = float(self.learner_group.version)
        metrics["timers/evaluation_s"] = time.perf_counter() - start
        return metrics

    # ------------------------------------------------------------------------------------------
    # metrics
    # ------------------------------------------------------------------------------------------
    def _metrics(self, episodes, reports, lags, learner_metrics, wait_s, update_s, sync_s, iteration_s):
        cfg = self.algo_config
        group = self.env_runner_group
        returns = [ep.reward for ep in episodes]
        lengths = [len(ep.token_ids) for ep in episodes]
        self._returns.extend(returns)
        self._lengths.extend(lengths)
        generated = sum(r.generated_tokens for r in reports)
        self._token_rate.append((generated, iteration_s))
        window_tokens = sum(t for t, _ in self._token_rate)
        window_s = sum(s for _, s in self._token_rate)
        self._totals["episodes"] += len(episodes)
        self._totals["generated_tokens"] += generated
        self._totals["env_steps"] += sum(r.env_steps for r in reports)
        out: dict[str, Any] = {
            "env_runners/episode_return_mean": self._returns.mean(),
            "env_runners/episode_len_mean": self._lengths.mean(),
            "env_runners/batch_episode_return_mean": mean(returns),
            "env_runners/batch_episode_return_max": max(returns),
            "env_runners/batch_episode_return_min": min(returns),
            "env_runners/batch_episode_len_mean": mean(lengths),
            "env_runners/batch_num_distinct_prompts": float(len({ep.prompt_id for ep in episodes})),
            "env_runners/policy_lag_mean": mean(lags),
            "env_runners/policy_lag_max": float(max(lags)),
            "env_runners/generated_tokens_per_s": window_tokens / window_s if window_s > 0 else 0.0,
            "env_runners/num_episodes_lifetime": float(self._totals["episodes"]),
            "env_runners/num_generated_tokens_lifetime": float(self._totals["generated_tokens"]),
            "env_runners/num_env_steps_sampled_lifetime": float(self._totals["env_steps"]),
            "env_runners/num_lost_episodes_lifetime": float(group.num_lost_episodes),
            "env_runners/num_restarts_lifetime": float(group.num_restarts),
            "env_runners/num_started_lifetime": float(sum(group.started_counters)),
            "env_runners/num_in_flight": float(group.in_flight),
            "env_runners/num_pending_episodes": float(len(self._pending)),
            "learners/idle_fraction": wait_s / iteration_s if iteration_s > 0 else 0.0,
            "learners/trajectories_per_s": len(episodes) / iteration_s if iteration_s > 0 else 0.0,
            "learners/version": float(self.learner_group.version),
            "timers/sample_wait_s": wait_s,
            "timers/learner_update_s": update_s,
            "timers/weight_sync_s": sync_s,
            "timers/iteration_s": iteration_s,
            "num_episodes": len(episodes),
        }
        from flashrl.env_runners import SKIP_REASONS

        for reason in SKIP_REASONS:
            out[f"env_runners/num_skipped_{reason}_lifetime"] = float(self._totals[f"skipped/{reason}"])
        buckets = LAG_BUCKETS if cfg.async_queue_size is None else max(LAG_BUCKETS, cfg.async_queue_size + 1)
        for bucket, fraction in lag_histogram(lags, buckets).items():
            out[f"env_runners/policy_lag_hist/{bucket}"] = fraction
        for key, value in learner_metrics.items():
            if isinstance(value, (int, float)):  # per-trajectory lists go to the histograms
                out[f"learners/{key}"] = value
        return out

    def _report(self, metrics, episodes, lags, learner_metrics) -> None:
        cfg = self.algo_config
        iteration = self.iteration + 1
        if self._tensorboard is not None:
            self._tensorboard.log(
                iteration,
                metrics,
                {
                    "hist/episode_len": [len(ep.token_ids) for ep in episodes],
                    "hist/generated_len": [ep.num_generated_tokens for ep in episodes],
                    "hist/policy_lag": lags,
                    "hist/episode_return": [ep.reward for ep in episodes],
                    "hist/drift": learner_metrics.get("drift_values", []),
                },
            )
        if cfg.console_every and iteration % cfg.console_every == 0:
            print(progress_line(iteration, metrics), flush=True)
        if cfg.checkpoint_frequency and iteration % cfg.checkpoint_frequency == 0:
            self._periodic_checkpoint(iteration)

    def _periodic_checkpoint(self, iteration: int) -> None:
        cfg = self.algo_config
        folder = cfg.checkpoint_dir or os.path.join(self.logdir, "checkpoints")
        self.save_to_path(os.path.join(folder, f"checkpoint_{iteration:06d}"))
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
        state = {
            "iteration": self.iteration,
            "sync_cursor": self._cursor,
            "runner_cursors": self.env_runner_group.started_counters,
            "learner_version": self.learner_group.version,
            "totals": dict(self._totals),
            # A resumed run restarts the prompt stream after the last started episode: what is in
            # flight or waiting for a batch now is never trained on, so the books count it as lost.
            "num_lost_episodes": (
                self.env_runner_group.num_lost_episodes + self.env_runner_group.in_flight + len(self._pending)
            ),
            "num_restarts": self.env_runner_group.num_restarts,
        }
        return write_checkpoint(
            path, config=self.algo_config.to_dict(), learner_group=self.learner_group, algorithm_state=state
        )

    def restore_from_path(self, path: str | os.PathLike[str]) -> None:
        """Load a checkpoint into this algorithm: learner state, weights on every runner, cursors."""
        checkpoint = read_checkpoint(path)
        state = checkpoint.algorithm_state
        self.learner_group.set_state(checkpoint.learner_state)
        group = self.env_runner_group
        if group.streaming:  # running episodes belong to the old weights and cursor: start over
            group.stop()
            group = self.env_runner_group = EnvRunnerGroup(group.spec, model_path=self.model_path)
            group.setup()
        # The books are the checkpoint's: its cursors started every episode it counts, and its own
        # in-flight and pending episodes are booked as lost. This run's unsaved episodes (running,
        # pending) belong to a timeline that is discarded with them.
        group.set_counters(state["runner_cursors"])
        group.num_lost_episodes = int(state.get("num_lost_episodes", 0))
        group.num_restarts = int(state.get("num_restarts", 0))
        self._weight_sync.after_restore(self.learner_group, group)  # every runner loads them; waits
        self._pending.clear()
        self._cursor = int(state["sync_cursor"])
        self._totals = Counter(state.get("totals", {}))
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
