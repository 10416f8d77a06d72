"""`FlashReinforce`: the algorithm driver, a Ray Tune `Trainable`.

One `train()` call is one iteration of the method (docs/design.md §1, §3)::

    episodes = stream.next_batch(version)    # next B finished episodes, B distinct prompts, as they arrive
    metrics  = learner_group.update(TrainBatch.from_episodes(episodes))     # exactly one optimizer step
    weight_sync.push(learner_group, env_runner_group)                       # runners keep sampling

The EnvRunners play episodes the whole time; the learner only waits when fewer than B finished
episodes are buffered (`learners/idle_fraction`). The episode stream (`flashrl.env_runners.stream`)
owns the batches, the admission budget and staleness bound, the books and the evaluation protocol;
`flashrl.metrics.IterationMetrics` builds each iteration's metrics. The user's callbacks
(`flashrl.callbacks`, `.callbacks(...)`) fire here and in the runners; their metrics join the result
under `callbacks/`, and `result["should_stop"]` sets Tune's `done`. `rollout_mode="sync_group"` is
the GRPO-style comparison: B/G prompts x G rollouts, wait for all, a group-mean baseline, weights
loaded before the next round.

A learner actor that dies or hangs breaks the learner group; with ``restart_failed_learners`` the
driver starts a new group and resumes from the run's newest checkpoint (``learner_faults``).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from ray.tune import Trainable
from ray.tune.execution.placement_groups import PlacementGroupFactory

from flashrl.algorithms.flash_reinforce.config import FlashReinforceConfig, refuse_checkpoint_code
from flashrl.algorithms.flash_reinforce.learner_faults import LearnerRestarts
from flashrl.callbacks import (
    CALLBACK_PREFIX,
    EVALUATION_CALLBACK_PREFIX,
    SHOULD_STOP,
    MetricsLogger,
    callbacks_class_path,
    make_callbacks,
)
from flashrl.checkpoints import (
    CheckpointSaveError,
    read_checkpoint,
    read_config,
    record_checkpoint,
    write_checkpoint,
)
from flashrl.env_runners import EnvRunnerGroup, EpisodeStream, RunnerReport
from flashrl.episode import Episode
from flashrl.learners import LearnerGroupError
from flashrl.loggers import ResultLogger, build_loggers
from flashrl.metrics import (
    IterationMetrics,
    IterationTimes,
    evaluation_line,
    iteration_histograms,
    policy_lags,
    progress_line,
)
from flashrl.metrics.console import RunProgress
from flashrl.plan import RunPlan, plan_run
from flashrl.weight_sync.layout import TransferLayout
from flashrl.weight_sync.route import route_for

logger = logging.getLogger("flashrl")

RESULT_KEY = "result"
"""In a periodic checkpoint's algorithm state: the numeric metrics of the iteration it saved (its result)."""


class FlashReinforce(Trainable):
    """FlashREINFORCE on Ray: EnvRunner actors stream episodes, a learner group takes one step per batch.

    Build it from a config (`config.build_algo()`), or let Ray Tune build it from
    `param_space=config` (a dict of the config's fields, grid searches allowed).
    """

    def __init__(self, config: FlashReinforceConfig | dict[str, Any] | None = None, **kwargs: Any) -> None:
        # Tune's Trainable takes a dict (to_dict keeps user code objects); the config object itself is kept
        # for setup(), which uses it when the dict is still its own.
        self._given_config = config.copy() if isinstance(config, FlashReinforceConfig) else None
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
        from flashrl.models import resolve_model
        from flashrl.ray_utils import check_cluster_nodes, check_resources, init_or_join

        given = self._given_config
        plain = {k: v for k, v in config.items() if not k.startswith("__")}
        self.algo_config = given if given is not None and given.to_dict() == plain else _as_config(config)
        self.algo_config.validate()
        logging.getLogger("flashrl").setLevel(self.algo_config.log_level)
        cfg = self.algo_config
        # Deterministic errors fail here, in seconds, before Ray or any engine starts: the model name,
        # and one env built and reset with every env config the run will use.
        self.model_path = resolve_model(cfg.model)
        self.callbacks = make_callbacks(cfg.callbacks_class)
        """The user's callbacks in this process (`flashrl.callbacks`); the runners hold their own."""
        self.metrics_logger = MetricsLogger()
        """Callback metrics of the iteration under way (`callbacks/<key>` in its result)."""
        self._tokenizer: Any = None  # the rollout dumps' decoder, loaded at the first dump
        self._last_periodic_save = time.monotonic()  # checkpoint_interval_minutes counts from here
        self._failed_saves = 0  # periodic saves in a row the disk refused (max_failed_checkpoints)
        train_size = _check_envs(cfg)
        init_or_join(framework_log_level=cfg.framework_log_level)
        check_resources(self.algo_config)
        # Every node runs the driver's versions and shares the checkpoint folder (flashrl.ray_utils).
        check_cluster_nodes([self._checkpoint_folder()] if cfg.checkpoint_dir or cfg.checkpoint_frequency
                            or cfg.checkpoint_interval_minutes else [])
        # With num_epochs, the horizon follows the training set's real size (kept for learner restarts).
        self.train_size = train_size
        self.total_updates = cfg.learner_spec(model=self.model_path, train_size=train_size).total_updates
        self.progress = RunProgress(self.total_updates)
        """The console's progress line on a terminal; its ``stop`` is the schedule's horizon unless the caller
        knows the run's own stop (the tuned examples' trainer loop sets its ``stop_iters``)."""
        self.stream: EpisodeStream | None = None
        self.plan: RunPlan = plan_run(cfg, model_path=self.model_path)
        """The run's processes as the config plans them (flashrl.plan): engine options, placement, memory."""
        self.learner_group = self._new_learner_group()
        self._engines_sleep = bool(self.plan.engine_options.get("sleep_mode"))
        """Colocated engines sleep while the learner updates (vLLM sleep mode; docs/engines.md)."""
        self.stream = EpisodeStream(
            EnvRunnerGroup(
                cfg.env_runner_spec(engine_options=dict(self.plan.runner_engine_options)), model_path=self.model_path
            ),
            rollout_mode=cfg.rollout_mode,
            group_size=cfg.group_size,
            evaluation_num_samples_per_prompt=cfg.evaluation_num_samples_per_prompt,
            evaluation_interval=cfg.evaluation_interval,
            evaluation_at_start=cfg.evaluation_at_start,
            train_size=train_size,
        )
        facts = self.env_runner_group.setup()
        self.pad_token_id = int(facts["pad_token_id"])
        # The route the runners' engines resolved (shm, or a GPU push route formed here, so that a
        # rendezvous failure surfaces at setup); sync_group waits for every runner to load.
        self._weight_sync = self._new_weight_sync()
        self._weight_sync.setup(self.learner_group, self.env_runner_group)
        self._learner_restarts = LearnerRestarts(
            restart=cfg.restart_failed_learners,
            max_restarts=cfg.max_num_learner_restarts,
            start_state={"iteration": self.iteration, **self.stream.state()},
        )
        self.iteration_metrics = IterationMetrics(
            smoothing_window=cfg.metrics_num_episodes_for_smoothing,
            max_lag=cfg.async_queue_size,
            datasource_key=cfg.evaluation_datasource_key,
        )
        # progress.csv, progress.jsonl, TensorBoard and the trackers named by `loggers` (flashrl.loggers).
        self._loggers: list[ResultLogger] = build_loggers(
            cfg.results_dir or os.path.join(self.output_dir, "results"),
            names=cfg.loggers,
            options=cfg.logger_options,
            tensorboard_dir=self.tensorboard_dir if cfg.tensorboard else None,
            config=cfg.serialize(),
            run_name=os.path.basename(os.path.normpath(self.logdir)),
        )
        self.callbacks.on_algorithm_init(algorithm=self, metrics_logger=self.metrics_logger)

    @property
    def tensorboard_dir(self) -> str:
        """The run's TensorBoard folder (`log_dir`, else `<output_dir>/tensorboard`); rollout dumps go beside."""
        return self.algo_config.log_dir or os.path.join(self.output_dir, "tensorboard")

    @property
    def output_dir(self) -> str:
        """The folder of this run's own outputs (`results/`, `tensorboard/`, `checkpoints/` by default): under
        Ray Tune with a local `storage_path`, the trial's folder there, beside Tune's `result.json` (its
        `logdir` is a working folder in Ray's session); else `logdir`."""
        storage = getattr(self, "_storage", None)
        if storage is not None:
            import pyarrow.fs

            if isinstance(storage.storage_filesystem, pyarrow.fs.LocalFileSystem):
                return storage.trial_fs_path
        return self.logdir

    def _new_learner_group(self) -> Any:
        from flashrl.learners import LearnerGroup

        cfg, placement = self.algo_config, self.plan.learners
        # Every LearnerSpec field the config also has, by name; the loss is the config's FlashReinforceLossSpec;
        # with num_epochs, the horizon follows the training set's real size.
        return LearnerGroup(
            cfg.learner_spec(model=self.model_path, train_size=self.train_size),
            num_learners=placement.num_learners,
            num_cpus_per_learner=placement.num_cpus,
            num_gpus_per_learner=placement.num_gpus,
            local=placement.local,
        )

    def _new_weight_sync(self) -> Any:
        """The route the runners' engines resolved, checked against the GPUs Ray gave each side."""
        layout = TransferLayout.of(self.learner_group.transfer_devices(), self.env_runner_group.transfer_devices)
        return route_for(self.env_runner_group.facts, wait_for_load=self.plan.wait_for_load, layout=layout)

    @property
    def env_runner_group(self) -> EnvRunnerGroup | None:
        """The env runners (the stream's: a restore replaces them)."""
        return self.stream.group if getattr(self, "stream", None) is not None else None

    @property
    def last_evaluation(self) -> dict[str | None, list[RunnerReport]]:
        """The reports of the latest `evaluate()`, per split (what was scored, episode by episode)."""
        return self.stream.last_evaluation

    def step(self) -> dict[str, Any]:
        """One iteration: collect a batch, one learner update, send the new weights.

        A learner fault (`LearnerGroupError`) restarts the learner group from the newest checkpoint
        and runs the iteration after it; or stops the run (see `learner_faults`).
        """
        while True:
            try:
                return self._step()
            except LearnerGroupError as error:
                self._restart_learners(error)

    def _step(self) -> dict[str, Any]:
        self.progress.start(self.iteration)
        at_start = self._evaluate_at_start()
        start = time.perf_counter()
        version_before = self.learner_group.version
        collected = self.stream.next_batch(version_before)
        episodes = collected.episodes
        lags = policy_lags(version_before, [ep.min_policy_version for ep in episodes])
        learner_metrics, update_s, sync_s = self._update_and_push(collected, version_before)
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
        metrics.update(self._learner_restarts.metrics())
        for report in collected.reports:
            self.metrics_logger.merge(report.callback_metrics)
        if self.stream.evaluation_due(self.iteration + 1):
            evaluation = self.evaluate()  # after the update: the policy of version iteration + 1
            self._print_evaluation(evaluation)
            metrics.update(evaluation)
        metrics.update(self.metrics_logger.reduce(CALLBACK_PREFIX))
        self.callbacks.on_train_result(
            algorithm=self, metrics_logger=self.metrics_logger, result=metrics, iteration=self.iteration + 1,
            episodes=episodes,
        )
        metrics.update(self.metrics_logger.reduce(CALLBACK_PREFIX))  # what on_train_result logged
        if metrics.get(SHOULD_STOP):
            metrics[SHOULD_STOP] = True
            metrics["done"] = True  # Tune's flag: the trial stops after this result
        self._report(metrics, episodes, lags, learner_metrics)
        return metrics

    def _update_and_push(self, collected: Any, version_before: int) -> tuple[dict[str, Any], float, float]:
        """One learner update on the collected batch, then the new weights to the runners.

        Returns the learner's metrics, the update's and the push's seconds. Colocated engines in
        sleep mode free their GPU first (generation waits), the learners free what their update cached
        (``LearnerGroup.release_memory``), and the engines wake with the new weights (the push), or here
        when no push comes (a skipped batch, a failed update).
        """
        from flashrl.learners import TrainBatch

        batch = TrainBatch.from_episodes(
            collected.episodes, pad_token_id=self.pad_token_id, group_ids=collected.group_ids
        )
        if self._engines_sleep:
            self.env_runner_group.sleep_engines()
        try:
            update_start = time.perf_counter()
            learner_metrics = self.learner_group.update(batch)
            update_s = time.perf_counter() - update_start
            del batch  # one update, then the batch is gone
            if self._engines_sleep:  # the engines wake next, next to the learners: what they cached goes first
                self.learner_group.release_memory()
            sync_s = 0.0
            if self.learner_group.version != version_before:  # a skipped batch leaves nothing new to send
                sync_s = self._weight_sync.push(self.learner_group, self.env_runner_group)
        finally:
            if self._engines_sleep:  # awake engines (woken by the push): nothing happens
                self.env_runner_group.wake_engines()
        return learner_metrics, update_s, sync_s

    def _restart_learners(self, error: LearnerGroupError) -> None:
        """A new learner group, resumed from the newest checkpoint of this run (or its start); or raise.

        A restart that fails in turn (a new actor dies while it loads) counts as another one.
        """
        while True:
            failed = self.learner_group
            if failed is None or failed.local or failed.failure is None:
                raise error  # not a fault of the learner actors: an error to fix, not to restart
            restarts = self._learner_restarts
            restarts.begin(failed.failure, error)  # raises when the run stops instead
            path = restarts.resume_point()
            logger.warning(
                "The learner group failed (%s); restarting it from %s (restart %d of at most %d).",
                failed.failure, path or "the start of the run", restarts.num_restarts, restarts.max_restarts,
            )
            try:
                self._resume_learners(failed, path)
                return
            except LearnerGroupError as again:
                error = again

    def _resume_learners(self, failed: Any, path: str | None) -> None:
        """Replace the failed learner group (and the runners) and resume from ``path`` (None: the start).

        The runners are replaced too: they serve a newer version than the restored one and never go
        back. The updates after the resume point are lost (counted) and redone from its data cursors.
        """
        start = time.perf_counter()
        restarts = self._learner_restarts
        try:
            self._weight_sync.stop()
        except LearnerGroupError:
            pass  # the learners' side of a transfer group died with them
        failed.shutdown()
        lost_from, books = failed.version, restarts.state()
        self.stream.restart_runners()  # serves the initial policy (version 0)
        self.learner_group = self._new_learner_group()
        self._weight_sync = self._new_weight_sync()
        if path is not None:
            self.restore_from_path(path)  # the checkpoint's weights on every runner, its cursors and books
        else:
            self.stream.set_state(restarts.start_state)
            self._iteration = int(restarts.start_state["iteration"])
        self._weight_sync.setup(self.learner_group, self.env_runner_group)
        lost = max(0, lost_from - self.learner_group.version)
        restarts.set_state(books)  # this run's books, not the checkpoint's
        restarts.num_lost_updates += lost
        logger.warning(
            "Learner group restarted in %.0f s at version %d (iteration %d); %d update(s) lost.",
            time.perf_counter() - start, self.learner_group.version, self.iteration, lost,
        )

    def _evaluate_at_start(self) -> dict[str, float]:
        """`evaluation_at_start`: evaluate the initial policy once, before the first update of a fresh run.

        As in Molt (`eval.eval_at_start`), a resumed run does not evaluate again. The result goes to
        the loggers at step 0 and into the first iteration's result, where an evaluation after that
        iteration's update (`evaluation_interval=1`) overrides it (`evaluation/learner_version` says
        which policy a result scored).
        """
        metrics = self.stream.evaluate_at_start(self.iteration, self.learner_group.version, evaluate=self.evaluate)
        for output in self._loggers if metrics else ():
            output.log(0, metrics)
        if metrics:
            self._print_evaluation(metrics)
        return metrics

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        """Write metrics taken outside `train()` (a recipe's evaluations) at iteration ``step`` to the run's
        loggers: progress files, TensorBoard, trackers."""
        for output in self._loggers:
            output.log(step, metrics)

    def save_checkpoint(self, checkpoint_dir: str) -> None:
        self.save_to_path(checkpoint_dir)

    def load_checkpoint(self, checkpoint: str | dict[str, Any]) -> None:
        if isinstance(checkpoint, dict):
            raise TypeError("FlashReinforce checkpoints are folders; got a dict.")
        self.restore_from_path(checkpoint)

    def cleanup(self) -> None:
        for output in getattr(self, "_loggers", ()):  # first: a tracker's run ends even if a stop fails
            output.close()
        self._loggers = []
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

    # ------------------------------------------------------------------------------------------
    # evaluation and reporting
    # ------------------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Evaluate the current policy on every evaluation split (same prompts every time).

        Per split, `evaluation_num_episodes` prompts (at most every task of a finite list once), each
        played `evaluation_num_samples_per_prompt` times at `evaluation_temperature` /
        `evaluation_top_p`; metrics as `flashrl.env_runners.evaluation` describes (`avg@k`, `pass@k`,
        per split and per benchmark). `flashrl eval` runs the same protocol on an in-process runner.
        Fires `on_evaluate_start` / `on_evaluate_end`; what the callbacks logged meanwhile (the
        evaluation episodes' `on_episode_end` included) is in `evaluation/callbacks/<key>`.
        """
        logger = MetricsLogger()
        self.callbacks.on_evaluate_start(algorithm=self, metrics_logger=logger)
        metrics = self.stream.evaluate(self.learner_group.version)
        for reports in self.stream.last_evaluation.values():
            for report in reports:
                logger.merge(report.callback_metrics)
        self.callbacks.on_evaluate_end(
            algorithm=self, metrics_logger=logger, evaluation_metrics=metrics, reports=self.stream.last_evaluation
        )
        metrics.update(logger.reduce(EVALUATION_CALLBACK_PREFIX))
        return metrics

    def _print_evaluation(self, metrics: dict[str, Any]) -> None:
        """An evaluation taken during training goes to the console when it is taken (unless silent)."""
        if self.algo_config.console_every:
            print(evaluation_line(metrics), flush=True)

    def _report(
        self, metrics: dict[str, Any], episodes: list[Episode], lags: list[int], learner_metrics: dict[str, Any]
    ) -> None:
        """The loggers, the console line, the rollout dump and the periodic checkpoint of the iteration just done."""
        cfg = self.algo_config
        iteration = self.iteration + 1
        histograms = iteration_histograms(episodes, lags, learner_metrics)
        for output in self._loggers:
            output.log(iteration, metrics, histograms)
        if cfg.console_every and iteration % cfg.console_every == 0:
            print(progress_line(iteration, metrics, multi_turn=self.iteration_metrics.multi_turn), flush=True)
            self.progress.show(iteration)
        if cfg.rollout_dump_every and iteration % cfg.rollout_dump_every == 0:
            self.dump_rollouts(iteration, episodes, lags, learner_metrics)
        minutes = cfg.checkpoint_interval_minutes
        due = bool(minutes) and time.monotonic() - self._last_periodic_save >= 60 * minutes
        if due or (cfg.checkpoint_frequency and iteration % cfg.checkpoint_frequency == 0):
            self._periodic_checkpoint(iteration, metrics)

    def dump_rollouts(
        self, iteration: int, episodes: list[Episode], lags: list[int], learner_metrics: dict[str, Any]
    ) -> str:
        """Write the first `rollout_dump_count` episodes of a batch as JSONL (`flashrl.metrics.rollouts`)."""
        from flashrl.metrics.rollouts import rollout_path, rollout_record, write_rollouts

        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        tokenizer = self._tokenizer
        records = [
            rollout_record(
                episode,
                decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
                iteration=iteration,
                learner_version=self.learner_group.version,
                batch_index=i,
                policy_lag=lags[i],
                learner_metrics=learner_metrics,
            )
            for i, episode in enumerate(episodes[: self.algo_config.rollout_dump_count])
        ]
        return write_rollouts(rollout_path(self.tensorboard_dir, iteration), records)

    def _periodic_checkpoint(self, iteration: int, metrics: dict[str, Any]) -> None:
        """Save and record a periodic checkpoint; a save the disk refused is logged and retried at the next
        interval, and stops the run (raises) only after `max_failed_checkpoints` failures in a row."""
        cfg = self.algo_config
        folder = self._checkpoint_folder()
        # Inside step(): Tune counts this iteration only when step() returns, so it is passed on.
        try:
            path = self._save(os.path.join(folder, f"checkpoint_{iteration:06d}"), iterations_done=iteration,
                              export_policy=cfg.checkpoint_export_policy, result=metrics)
        except CheckpointSaveError as error:
            self._last_periodic_save = time.monotonic()  # checkpoint_interval_minutes: retried an interval on
            self._failed_saves += 1
            if self._failed_saves >= cfg.max_failed_checkpoints:
                raise CheckpointSaveError(
                    error.errno, f"{error.strerror} {self._failed_saves} periodic saves in a row failed "
                    f"(max_failed_checkpoints={cfg.max_failed_checkpoints}), so the run stops here; resume it "
                    "(--resume, or FlashReinforce.from_checkpoint) once the disk is fixed.", error.filename,
                ) from error
            logger.error("%s Training goes on; the next periodic save retries (%d of %d failed in a row).",
                         error.strerror, self._failed_saves, cfg.max_failed_checkpoints)
            return
        self._failed_saves = 0
        record_checkpoint(folder, path, keep_last_n=cfg.num_checkpoints_to_keep)  # `latest`, pruning
        self._last_periodic_save = time.monotonic()

    # ------------------------------------------------------------------------------------------
    # checkpoints
    # ------------------------------------------------------------------------------------------
    def save_to_path(self, path: str | os.PathLike[str] | None = None, *, export_policy: bool = True) -> str:
        """Write a checkpoint folder atomically (learner state, data cursors, config; `flashrl.checkpoints`).

        ``export_policy`` adds the policy as a Hugging Face folder (``policy/``, what vLLM and
        transformers load); a checkpoint without it still resumes training. ``path`` None:
        ``<output_dir>/checkpoint_<iteration>``.
        """
        if path is None:
            path = os.path.join(self.output_dir, f"checkpoint_{self.iteration:06d}")
        return self._save(path, iterations_done=self.iteration, export_policy=export_policy)

    def _checkpoint_folder(self) -> str:
        """Where periodic checkpoints go: ``checkpoint_dir``, else ``<output_dir>/checkpoints``."""
        return self.algo_config.checkpoint_dir or os.path.join(self.output_dir, "checkpoints")

    def _save(self, path: str | os.PathLike[str], *, iterations_done: int, export_policy: bool = True,
              result: dict[str, Any] | None = None) -> str:
        # sync_cursor, runner_cursors, totals, num_lost_episodes, num_restarts: the stream's books.
        state = {
            "iteration": iterations_done,
            "learner_version": self.learner_group.version,
            **self.stream.state(),
            **self._learner_restarts.state(),
        }
        if result is not None:  # the saved iteration's numbers: a resumed recipe rebuilds a row it never wrote
            state[RESULT_KEY] = {k: float(v) for k, v in result.items() if _is_number(v)}
        config = self.algo_config.serialize()
        config["callbacks_class"] = callbacks_class_path(self.algo_config.callbacks_class)  # a class by its path
        path = write_checkpoint(path, config=config, learner_group=self.learner_group, algorithm_state=state,
                                export_policy=export_policy)
        self._learner_restarts.checkpoint = path  # where a learner restart resumes
        return path

    def restore_from_path(self, path: str | os.PathLike[str]) -> None:
        """Load a checkpoint into this algorithm: learner state, weights on every runner, cursors."""
        checkpoint = read_checkpoint(path)  # every file checked against the manifest first
        state = checkpoint.algorithm_state
        served = self.learner_group.version  # the runners serve this version's weights
        # The manifest's layout, never a guess from the files present; DCP reshards to this number of learners.
        self.learner_group.load_state(checkpoint.learner_path, layout=checkpoint.learner_layout)
        if self.learner_group.version < served and not self.env_runner_group.streaming:
            # A runner never goes back to an older version (it ignores one): going back in time takes
            # fresh runners (a streaming group is replaced by set_state).
            self.stream.restart_runners()
        # The books and cursors are the checkpoint's; a streaming group is replaced by a fresh one.
        self.stream.set_state(state)
        group = self.env_runner_group
        self._weight_sync.after_restore(self.learner_group, group)  # every runner loads them; waits
        self._iteration = int(state["iteration"])
        for output in self._loggers:  # the logs continue the checkpoint's timeline (flashrl.loggers.rewind)
            output.rewind(self._iteration)
        self._learner_restarts.set_state(state)
        self._learner_restarts.checkpoint = os.path.abspath(os.fspath(path))
        self.callbacks.on_checkpoint_loaded(algorithm=self, path=os.fspath(path))

    @classmethod
    def from_checkpoint(
        cls,
        path: str | os.PathLike[str],
        *,
        config: FlashReinforceConfig | None = None,
        trust_config_code: bool = False,
        **config_overrides: Any,
    ) -> FlashReinforce:
        """A new algorithm built from a config and a checkpoint's state.

        The config is ``config`` (your own, e.g. rebuilt by your script: the checkpoint's is not read), else
        the checkpoint's ``config.json``; ``config_overrides`` set settings on top. A checkpoint's config is
        data: a stored setting that names code (a ``"module:name"`` path, an Agent-v0 ``command``, vLLM's
        ``engine_args``; ``flashrl.checkpoints.stored_code``) is refused with an error naming each one,
        unless you pass it again (``config`` or an override) or ``trust_config_code=True`` says that you
        trust whoever wrote the checkpoint.
        """
        from flashrl.ray_utils import init_or_join

        if config is not None:
            config = config.copy().update_from_dict(config_overrides)
        else:
            stored = read_config(path)
            if not trust_config_code:
                refuse_checkpoint_code(os.fspath(path), stored, given=config_overrides, fix=(
                    "pass these settings again from your own code (FlashReinforce.from_checkpoint(path, "
                    "config=your_config), or as overrides, e.g. from_checkpoint(path, env_config={...})), or, "
                    "if you trust whoever wrote this checkpoint, from_checkpoint(path, trust_config_code=True)"))
            config = FlashReinforceConfig.from_dict(stored).update_from_dict(config_overrides)
        init_or_join(framework_log_level=config.framework_log_level)
        algo = cls(config=config)
        algo.restore_from_path(path)
        return algo

    def stop(self) -> None:
        """Release the actors and the engines (Tune calls this at the end of a trial)."""
        super().stop()


def _check_envs(config: FlashReinforceConfig) -> int | None:
    """Build and reset one env of each config the run uses (training; evaluation if it evaluates).

    Returns the training env's finite task count (None: an infinite source; max_samples needs a finite one).
    """
    from flashrl.algorithms.flash_reinforce.config import ConfigError
    from flashrl.env_runners.env_check import build_env_once
    from flashrl.env_runners.evaluation import evaluation_splits

    spec = config.env_runner_spec()
    train_size = build_env_once(spec.env, spec.env_config, seed=spec.seed, timeout_s=spec.env_timeout_s)
    if train_size is None and spec.max_samples is not None:
        raise ConfigError(
            f"max_samples: expected a finite training set to cut, got env {spec.env!r} with {spec.env_config!r}, "
            "which draws tasks from an infinite source. Fix: set max_samples=None, or give the env a dataset"
        )
    if config.evaluation_interval or config.evaluation_at_start:
        for split, env_config in evaluation_splits(spec).items():
            what = "evaluation_env_config" if split is None else f"evaluation_splits[{split!r}]"
            build_env_once(spec.env, env_config, what=what, seed=spec.seed, timeout_s=spec.env_timeout_s)
    return train_size


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _as_config(config: dict[str, Any] | FlashReinforceConfig) -> FlashReinforceConfig:
    if isinstance(config, FlashReinforceConfig):
        return config.copy()
    # Tune adds private keys such as "__trial_info__"; they are not part of the config.
    return FlashReinforceConfig.from_dict({k: v for k, v in config.items() if not k.startswith("__")})
