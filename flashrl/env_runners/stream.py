"""`EpisodeStream`: the batches a learner trains on, taken from an `EnvRunnerGroup`'s episodes.

Two ways to fill a batch of B episodes (docs/design.md §3):

- ``async`` (the method): the next B finished episodes of B distinct prompts, in arrival order
  (`BatchAssembler`); the runners keep sampling while the learner updates. With
  ``async_queue_size`` = Q set, the runners start training episodes only as an admission budget
  allows (at most Q batches ahead of the learner: ``EnvRunnerSpec.async_queue_size``) and
  episodes more than Q versions behind the learner are dropped (``stale``).
- ``sync_group`` (the GRPO comparison): B/G prompts x G rollouts, waiting for all of them.

The stream keeps the books of every episode the runners started: trained on (delivered in a batch),
waiting for a later batch (`pending`), dropped with a reason (`totals["skipped/<reason>"]`), lost with
a runner that died (the group's `num_lost_episodes`), or still running. It also runs the evaluation
protocol (`flashrl.env_runners.evaluation`) over the group and says when it is due. It takes plain
arguments, never an algorithm's config.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from flashrl.env_runners.batching import BatchAssembler
from flashrl.env_runners.data_passes import DataPasses
from flashrl.env_runners.evaluation import run_evaluation
from flashrl.env_runners.group import EnvRunnerGroup, EnvRunnerGroupError
from flashrl.env_runners.spec import EnvRunnerSpec
from flashrl.env_runners.types import SKIP_REASONS, RunnerReport
from flashrl.episode import Episode
from flashrl.metrics.iteration import StreamCounts

ROLLOUT_MODES = ("async", "sync_group")
WAIT_SLICE_S = 5.0
"""Longest single wait on the runners' reports (the overall limit is sample_timeout_s)."""


@dataclass
class CollectedBatch:
    """One batch of episodes and what came with it."""

    episodes: list[Episode]
    """The batch, in arrival order (async) or by (prompt index, replica) (sync_group)."""
    group_ids: list[int] | None
    """sync_group: each episode's prompt index (its group); None in async mode."""
    reports: list[RunnerReport]
    """The runner reports received while the batch was collected."""
    wait_s: float
    """Seconds spent waiting for the batch."""

    @property
    def generated_tokens(self) -> int:
        return sum(report.generated_tokens for report in self.reports)

    @property
    def env_steps(self) -> int:
        return sum(report.env_steps for report in self.reports)


class EpisodeStream:
    """The episode stream of one run over an `EnvRunnerGroup` (set up by the caller).

    Args:
        group: the runners; the stream starts their streaming at its first async batch.
        rollout_mode: ``"async"`` or ``"sync_group"``.
        group_size: G, rollouts per prompt in sync_group mode (B must be a multiple).
        evaluation_num_samples_per_prompt: k of avg@k.
        evaluation_interval: evaluate after every N-th iteration; None = never.
        evaluation_at_start: evaluate the initial policy once before the first update of a fresh run.
        wait_slice_s: longest single wait on the runners (a shorter one notices a stall sooner).
        train_size: the training env's finite task count (`build_env_once`; the runners read the same
            env), for the checkpoint's data passes; None = an infinite source.

    The batch size B, ``async_queue_size``, ``sample_timeout_s`` and the evaluation settings are the
    group's `EnvRunnerSpec`'s.
    """

    def __init__(
        self,
        group: EnvRunnerGroup,
        *,
        rollout_mode: str = "async",
        group_size: int = 1,
        evaluation_num_samples_per_prompt: int = 1,
        evaluation_interval: int | None = None,
        evaluation_at_start: bool = False,
        wait_slice_s: float = WAIT_SLICE_S,
        train_size: int | None = None,
    ) -> None:
        if rollout_mode not in ROLLOUT_MODES:
            raise ValueError(
                f"EpisodeStream: expected rollout_mode in {ROLLOUT_MODES}, got {rollout_mode!r}. "
                "Fix: use 'async' (the method) or 'sync_group' (the GRPO comparison)."
            )
        b = group.spec.train_batch_size
        if rollout_mode == "sync_group" and (group_size < 1 or b % group_size):
            raise ValueError(
                f"EpisodeStream: expected train_batch_size={b} to be a multiple of group_size >= 1 in "
                f"'sync_group' mode, got group_size={group_size!r}. Fix: pick a divisor of train_batch_size."
            )
        self.group = group
        self.rollout_mode = rollout_mode
        self.group_size = int(group_size)
        self.evaluation_num_samples_per_prompt = int(evaluation_num_samples_per_prompt)
        self.evaluation_interval = evaluation_interval
        self.evaluation_at_start = bool(evaluation_at_start)
        self.wait_slice_s = float(wait_slice_s)
        self.train_size = train_size
        self.pending: deque[Episode] = deque()
        """Delivered episodes that could not join a batch (their prompt was in it, or it was full)."""
        self.totals: Counter[str] = Counter()
        """Lifetime books: ``episodes`` (trained on), ``generated_tokens``, ``env_steps``,
        ``skipped/<reason>``."""
        self.cursor = 0
        """sync_group: the next prompt index."""
        self.last_evaluation: dict[str | None, list[RunnerReport]] = {}
        """The reports of the latest `evaluate()`, per split (what was scored, episode by episode)."""
        self._evaluated_at_start = False

    @property
    def spec(self) -> EnvRunnerSpec:
        return self.group.spec

    @property
    def batch_size(self) -> int:
        return int(self.spec.train_batch_size)

    @property
    def prompts_per_batch(self) -> int:
        """Distinct prompts in one batch: B (async) or B / G (sync_group)."""
        return self.batch_size // self.group_size if self.rollout_mode == "sync_group" else self.batch_size

    # ------------------------------------------------------------------------------------------
    # batches
    # ------------------------------------------------------------------------------------------
    def next_batch(self, learner_version: int) -> CollectedBatch:
        """The next batch for the learner at `learner_version`; its episodes count as trained on."""
        if self.rollout_mode == "async":
            collected = self._collect_async(learner_version)
        else:
            collected = self._collect_sync()
        self.totals["episodes"] += len(collected.episodes)
        self.totals["generated_tokens"] += collected.generated_tokens
        self.totals["env_steps"] += collected.env_steps
        return collected

    def _collect_async(self, learner_version: int) -> CollectedBatch:
        """The next B finished episodes of B distinct prompts, in arrival order (`BatchAssembler`).

        Episodes that cannot join the batch wait in `pending` (bounded; the oldest beyond it is
        dropped and counted). With `async_queue_size` set, stale episodes are dropped and counted,
        and the runners start new episodes only as the admission budget allows (`allowed_starts`).
        `sample_timeout_s` counts from the last time the batch grew: episodes that keep arriving
        without filling it (too few distinct prompts) are not progress.
        """
        spec, group = self.spec, self.group
        assembler = BatchAssembler(
            self.batch_size,
            pending_capacity=self.pending_capacity,
            learner_version=learner_version,
            max_lag=spec.async_queue_size,
        )
        reports: list[RunnerReport] = []
        wait_start = time.perf_counter()
        try:
            pending, self.pending = self.pending, deque()
            assembler.offer_all(pending)
            self._book_skipped(assembler.take_skipped())
            if not group.streaming:
                group.start_streaming(self.allowed_starts(assembler.blocked()))
            else:
                group.grant(self.allowed_starts(assembler.blocked()))
            last_growth, arrived, stale, repeated = wait_start, 0, 0, assembler.repeated
            dropped: Counter[str] = Counter()  # by reason, since the batch last grew (the stall error's)
            while not assembler.full:
                new = group.next_reports(timeout_s=self.wait_slice_s)
                reports.extend(new)
                size = len(assembler.batch)
                for report in new:
                    self._book_skipped(report.skipped)  # now: the admission budget counts them
                    dropped.update(report.skipped)
                    arrived += len(report.episodes)
                    assembler.offer_all(report.episodes)
                skipped = assembler.take_skipped()
                stale += skipped["stale"]
                dropped.update(skipped)
                self._book_skipped(skipped)
                group.grant(self.allowed_starts(assembler.blocked()))
                now = time.perf_counter()
                if len(assembler.batch) > size:
                    last_growth, arrived, stale, repeated = now, 0, 0, assembler.repeated
                    dropped = Counter()
                elif now - last_growth > spec.sample_timeout_s:
                    raise self._stalled(assembler, arrived, assembler.repeated - repeated, stale, dropped)
        except BaseException:
            # Kept on the books: nothing is dropped silently.
            self.pending = deque([*assembler.batch, *assembler.later])
            raise
        wait_s = time.perf_counter() - wait_start
        self.pending = assembler.later
        # The budget the next batch may use is granted now, so the runners sample during the update.
        group.grant(self.allowed_starts(assembler.blocked(set()), consumed=len(assembler.batch)))
        return CollectedBatch(assembler.batch, None, reports, wait_s)

    @property
    def pending_capacity(self) -> int:
        """Most episodes `pending` holds: one poll of every runner can overflow a batch by N x B."""
        return (self.spec.num_env_runners + 1) * self.batch_size

    def allowed_starts(self, blocked: int, consumed: int = 0) -> int | None:
        """Training episodes the runners may have started in total under `async_queue_size` (Q).

        The rollout side may run at most Q batches ahead of the learner. Per episode: started, not yet
        taken by the learner, not dropped and not lost (in flight, buffered, in the batch being
        collected, waiting in `pending`) stays <= Q x B.
        The `blocked` waiting episodes (their prompt is already in the batch) do not count, so too
        few distinct finished episodes never deadlock the stream. `consumed`: episodes of the batch
        just collected, not yet booked as trained on. None when Q is not set (no budget).
        """
        q = self.spec.async_queue_size
        if q is None:
            return None
        trained = self.totals["episodes"] + consumed
        skipped = sum(v for k, v in self.totals.items() if k.startswith("skipped/"))
        settled = trained + skipped + self.group.num_lost_episodes + blocked
        return settled + q * self.batch_size

    def _book_skipped(self, skipped: Mapping[str, int]) -> None:
        self.totals.update({f"skipped/{k}": v for k, v in skipped.items()})

    def _stalled(
        self, assembler: BatchAssembler, arrived: int, repeated: int, stale: int,
        dropped: Mapping[str, int] | None = None,
    ) -> EnvRunnerGroupError:
        """The error of a batch that has not grown for `sample_timeout_s`, with its likely cause and fix.

        ``dropped``: episodes dropped since the batch last grew, by reason; when there are any, the error
        counts each with the setting or code that governs it (`drop_causes`) instead of blaming slowness."""
        spec, b = self.spec, self.batch_size
        collected = len(assembler.batch)
        drops = {k: v for k, v in (dropped or {}).items() if v}
        healthy, configured = getattr(self.group, "num_healthy", 0), getattr(self.group, "num_runners", 0)
        short = "" if healthy >= configured else (
            f" Only {healthy} of {configured} env runners run: the others wait for a node with room "
            "(env_runners/num_healthy; bring a node back or add one)."
        )
        if drops and not arrived:
            env_error = getattr(self.group, "last_env_error", None)
            last = "" if env_error is None or "env_error" not in drops else f" The last env error was in {env_error}"
            return EnvRunnerGroupError(
                f"No finished episode arrived for {spec.sample_timeout_s:g} s (sample_timeout_s); {collected}/{b} "
                f"collected, {self.group.in_flight} in flight; meanwhile {sum(drops.values())} episodes ended "
                f"dropped: {drop_causes(drops, spec)}. Expected episodes that get through: the runners are not "
                f"slow, their episodes fail. Fix: what the largest count names (the env_runners/num_skipped_<reason>"
                f"_lifetime metrics count them).{last}{short}"
            )
        if not arrived:
            env_error = getattr(self.group, "last_env_error", None)
            blame = "" if env_error is None else (
                " If episodes keep ending in env errors (env_runners/num_skipped_env_error_lifetime), fix the env "
                f"instead; the last one was in {env_error}"
            )
            return EnvRunnerGroupError(
                f"No finished episode arrived for {spec.sample_timeout_s:g} s (sample_timeout_s); "
                f"{collected}/{b} collected, {self.group.in_flight} in "
                f"flight. Raise sample_timeout_s for slow environments, or lower max_new_tokens.{blame}{short}"
            )
        what = (
            f"The batch has not grown for {spec.sample_timeout_s:g} s (sample_timeout_s): {arrived} episodes "
            f"arrived meanwhile, but {repeated} repeated one of the {len(assembler.prompts)} prompts already "
            f"in the batch and {stale} were stale (async_queue_size={spec.async_queue_size}); "
            f"{collected}/{b} collected."
        )
        others = {k: v for k, v in drops.items() if k != "stale"}
        if others:
            what += f" Besides, {sum(others.values())} episodes ended dropped: {drop_causes(others, spec)}."
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

    def _collect_sync(self) -> CollectedBatch:
        """B/G prompts x G rollouts, waiting for all of them (the comparison baseline)."""
        prompts = self.prompts_per_batch
        indices = list(range(self.cursor, self.cursor + prompts))
        self.cursor += prompts
        start = time.perf_counter()
        reports = self.group.sample(indices, group_size=self.group_size)
        wait_s = time.perf_counter() - start
        for report in reports:
            self._book_skipped(report.skipped)
        episodes = [ep for report in reports for ep in report.episodes]
        episodes.sort(key=lambda ep: (ep.info["episode_index"], ep.info["replica"]))
        if not episodes:
            raise EnvRunnerGroupError(
                f"Every one of the {prompts * self.group_size} episodes of this round was dropped "
                f"(see env_runners/num_skipped/*); check the environment and max_episode_tokens."
            )
        group_ids = [int(ep.info["episode_index"]) for ep in episodes]
        return CollectedBatch(episodes, group_ids, reports, wait_s)

    # ------------------------------------------------------------------------------------------
    # evaluation
    # ------------------------------------------------------------------------------------------
    def evaluate(self, learner_version: int) -> dict[str, float]:
        """Evaluate the runners' current policy on every evaluation split (same prompts every time).

        Per split, `evaluation_num_episodes` prompts (at most every task of a finite list once), each
        played `evaluation_num_samples_per_prompt` times at `evaluation_temperature` /
        `evaluation_top_p`; metrics as `flashrl.env_runners.evaluation` describes (`avg@k`, `pass@k`,
        per split and per benchmark), with the policy's `evaluation/learner_version` and the time taken.
        """
        start = time.perf_counter()
        result = run_evaluation(self.group, self.spec, num_samples=self.evaluation_num_samples_per_prompt)
        self.last_evaluation = result.reports
        metrics = dict(result.metrics)
        metrics["evaluation/learner_version"] = float(learner_version)
        metrics["timers/evaluation_s"] = time.perf_counter() - start
        return metrics

    def evaluate_at_start(
        self, iteration: int, learner_version: int, evaluate: Callable[[], dict[str, float]] | None = None
    ) -> dict[str, float]:
        """`evaluation_at_start`: the initial policy's evaluation, once, before a fresh run's first update.

        As in Molt (`eval.eval_at_start`), a resumed run (iteration or version past 0) does not
        evaluate again. Returns {} when there is nothing to do. ``evaluate``: what evaluates (the
        algorithm's `evaluate`, with its callbacks); default this stream's `evaluate`.
        """
        if not self.evaluation_at_start or iteration != 0 or learner_version != 0 or self._evaluated_at_start:
            return {}
        self._evaluated_at_start = True
        return evaluate() if evaluate is not None else self.evaluate(learner_version)

    def evaluation_due(self, iterations_done: int) -> bool:
        """Whether an evaluation follows the update of iteration `iterations_done` (counted from 1)."""
        return bool(self.evaluation_interval) and iterations_done % self.evaluation_interval == 0

    # ------------------------------------------------------------------------------------------
    # books and checkpoints
    # ------------------------------------------------------------------------------------------
    def counts(self) -> StreamCounts:
        """The lifetime books now (what the iteration's metrics report)."""
        group = self.group
        return StreamCounts(
            episodes=self.totals["episodes"],
            generated_tokens=self.totals["generated_tokens"],
            env_steps=self.totals["env_steps"],
            skipped={reason: self.totals[f"skipped/{reason}"] for reason in SKIP_REASONS},
            lost=group.num_lost_episodes,
            restarts=group.num_restarts,
            started=sum(group.started_counters),
            in_flight=group.in_flight,
            pending=len(self.pending),
            healthy_runners=group.num_healthy,
            configured_runners=group.num_runners,
        )

    @property
    def data_passes(self) -> DataPasses | None:
        """The training set's passes (`flashrl.env_runners.data_passes`); None for an infinite source."""
        return DataPasses.for_env(self.train_size, max_samples=self.spec.max_samples, seed=int(self.spec.seed))

    def data_progress(self) -> dict[str, Any] | None:
        """Where the passes stand (tasks per pass, passes completed, position): from the data cursors."""
        passes = self.data_passes
        if passes is None:
            return None
        cursors = [self.cursor] if self.rollout_mode == "sync_group" else self.group.started_counters
        return passes.progress(cursors)

    def state(self) -> dict[str, Any]:
        """The stream's part of a checkpoint (plain values, JSON-ready)."""
        group = self.group
        return {
            "sync_cursor": self.cursor,
            "runner_cursors": group.started_counters,
            # the passes are a function of the cursors; saved to check that a resume has the same set
            "data_passes": self.data_progress(),
            "totals": dict(self.totals),
            # A resumed run restarts the prompt stream after the last started episode: what is in
            # flight or waiting for a batch now is never trained on, so the books count it as lost.
            "num_lost_episodes": group.num_lost_episodes + group.in_flight + len(self.pending),
            "num_restarts": group.num_restarts,
        }

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Take a checkpoint's books and cursors (`state()`); a streaming group is replaced by a fresh one.

        Running episodes belong to the old weights and cursors: the group is stopped and a new one
        set up (the caller then loads the checkpoint's weights into `group`). The books are the
        checkpoint's: its cursors started every episode it counts, and its own in-flight and pending
        episodes are booked as lost; this run's unsaved episodes belong to a discarded timeline.
        """
        missing = sorted({"sync_cursor", "runner_cursors"} - set(state))
        if missing:
            raise KeyError(
                f"EpisodeStream.set_state: expected the keys of state() in the checkpoint's algorithm state, "
                f"missing {missing} (got {sorted(state)}). Fix: restore from a checkpoint this flashrl wrote."
            )
        if self.group.streaming:
            self.restart_runners()
        group = self.group
        if self.data_passes is not None:
            self.data_passes.check_resume(state.get("data_passes"))
        group.set_counters(state["runner_cursors"])
        group.num_lost_episodes = int(state.get("num_lost_episodes", 0))
        group.num_restarts = int(state.get("num_restarts", 0))
        self.pending.clear()
        self.cursor = int(state["sync_cursor"])
        self.totals = Counter(state.get("totals", {}))

    def restart_runners(self) -> None:
        """Replace the runners by a fresh group (same spec and model) serving the initial policy.

        A restore whose weights are older than those the runners serve needs it: a runner never goes
        back to an older version (`EnvRunner.set_weights` ignores one). The old group's episodes are
        discarded with it; the caller then sets the books and loads the weights (`set_state`).
        """
        group = self.group
        group.stop()
        self.group = EnvRunnerGroup(group.spec, model_path=group.model_path)
        self.group.setup()

    def stop(self) -> None:
        """Stop the runners."""
        self.group.stop()


DROP_CAUSES: dict[str, str] = {
    "empty": "no model call (an agent that returns without calling the model: its code) or no generated token "
             "(a prompt that fills max_episode_tokens={max_episode_tokens})",
    "env_error": "the env or the agent raised (their code; the same error ENV_ERROR_LIMIT times in a row stops "
                 "the run)",
    "env_timeout": "an env call past env_timeout_s={env_timeout_s}, or an agent past agent_wall_time_s="
                   "{agent_wall_time_s}",
    "bad_reward": "a reward that is not a real number (the env's step, the agent's result or its reward_fn)",
    "non_finite": "a NaN or inf reward or log-prob (the env's reward, the engine)",
    "invalid_logprob": "a log-prob above 0 (the engine)",
    "aborted": "a model turn the engine aborted (the engine)",
    "over_long": "longer than max_episode_tokens={max_episode_tokens}",
    "request_error": "a request the engine rejected (max_episode_tokens={max_episode_tokens}, max_new_tokens="
                     "{max_new_tokens})",
    "stale": "more than async_queue_size={async_queue_size} versions behind the learner",
    "pending_overflow": "the queue of waiting episodes overflowed (train_batch_size={train_batch_size}: too few "
                        "distinct prompts)",
}
"""What governs each drop reason (`flashrl.env_runners.types.SKIP_REASONS`): the setting or the code to fix."""


def drop_causes(drops: Mapping[str, int], spec: Any) -> str:
    """``"3 env_timeout (an env call past env_timeout_s=5, ...); 1 empty (...)"``, the largest count first."""
    values = {name: getattr(spec, name, "?") for name in (
        "max_episode_tokens", "env_timeout_s", "agent_wall_time_s", "max_new_tokens", "async_queue_size",
        "train_batch_size")}
    parts = []
    for reason, count in sorted(drops.items(), key=lambda item: (-item[1], item[0])):
        cause = DROP_CAUSES.get(reason)
        parts.append(f"{count} {reason}" + ("" if cause is None else f" ({cause.format(**values)})"))
    return "; ".join(parts)
