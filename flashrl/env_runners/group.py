"""`EnvRunnerGroup`: the EnvRunner actors, their episode stream, weight broadcasts and restarts.

The episode stream (`EpisodeStream`) sees one stream of finished episodes. Each runner always has
one outstanding `poll` call; `next_reports()` returns whichever replies are ready (each reply
carries a batch of episodes, so the stream costs one round trip per batch, not per episode). A
runner that fails is replaced at once (the others keep sampling meanwhile): whatever Ray raises for
it (any `ray.exceptions.RayError` but a timeout: the actor died, its worker crashed, the OOM killer
took it, its node died, an object it held was lost, or its own code raised). The episodes it was
playing or holding are counted in `num_lost_episodes`, never dropped from the books silently; its
replacement goes on from its last reported data cursor.

Elastic runners: a replacement streams once Ray has placed it (its first call, a ping, answered). When
its node left and no other node has room, Ray keeps it waiting: the run goes on with the runners it
has (`num_healthy` of `num_runners`, the metric `env_runners/num_healthy`; one console line after
`PLACEMENT_WAIT_S`), and the waiting runner starts, with the current weights, as soon as a node with
room joins (checked at every poll, without blocking). docs/runtime.md, Faults.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError

from flashrl.callbacks import ship_by_value
from flashrl.env_runners.env_check import runner_env_spec, runner_spec
from flashrl.env_runners.env_errors import EnvErrorStreak
from flashrl.env_runners.env_runner import EnvRunner
from flashrl.env_runners.spec import EnvRunnerSpec
from flashrl.env_runners.types import RunnerReport
from flashrl.ray_utils import kill_and_confirm
from flashrl.user_code import Shipped
from flashrl.weight_sync.messages import LoadWeights

logger = logging.getLogger("flashrl.env_runners")

POLL_TIMEOUT_S = 1.0
"""How long a runner holds a poll open waiting for its first finished episode (a heartbeat)."""
ENGINE_START_TIMEOUT_S = 900.0
"""The least time `setup()` gives the engines to start (a short `sample_timeout_s` does not cut it).
flashrl's own choice: vLLM's CPU start took 20-60 s here, several minutes on a busy host."""
PLACEMENT_WAIT_S = 30.0
"""How long a replacement runner waits for Ray to place it before the console says the run goes on without
it. flashrl's own choice: a new actor's process starts in 5-20 s on a busy host."""
REPEATED_ERROR_LIMIT = 3
"""The same error raised by a runner's code this many times in a row stops the run (no more restarts)."""


class EnvRunnerGroupError(RuntimeError):
    """The env runners cannot go on (too many restarts, no episode within the timeout)."""


@dataclass
class _RunnerSlot:
    actor: Any
    started: int = 0
    """Last reported data cursor (training episodes started)."""
    in_flight: int = 0
    buffered: int = 0
    poll: Any = None
    granted: int | None = None
    """Start limit last sent to the runner (absolute data cursor); None = no admission budget."""
    placing: Any = None
    """A replacement's ping until it answers (Ray has not placed the actor yet); None once it runs."""
    placing_since: float = 0.0
    """When the replacement was asked for (``time.monotonic()``)."""
    announced: bool = False
    """Whether the console said that this replacement cannot be placed (it says so again when it starts)."""


class EnvRunnerGroup:
    """Start, poll, update and restart the EnvRunner actors of one run.

    Args:
        spec: what the runners need of the run (`algorithm_config.env_runner_spec()`).
        model_path: local Hugging Face folder of the initial policy.
        start_counters: per runner index, training episodes already started (resume).
    """

    def __init__(
        self, spec: EnvRunnerSpec, *, model_path: str, start_counters: Sequence[int] | None = None
    ) -> None:
        if not isinstance(spec, EnvRunnerSpec):
            raise TypeError(
                f"EnvRunnerGroup: expected an EnvRunnerSpec, got {type(spec).__name__}. "
                "Fix: pass config.env_runner_spec()."
            )
        self.spec = spec
        self.model_path = model_path
        self.num_runners = spec.num_env_runners
        counters = list(start_counters or [])
        counters += [0] * (self.num_runners - len(counters))
        ship_by_value(spec.callbacks_class)  # the user's class reaches the actors by value
        self._actor_cls = ray.remote(
            num_cpus=spec.num_cpus_per_env_runner,
            num_gpus=spec.num_gpus_per_env_runner,
            resources=dict(spec.custom_resources_per_env_runner),
            max_restarts=0,
        )(EnvRunner)
        self._env_spec = _driver_env_spec(spec.env)
        self._runner_spec = runner_spec(spec)  # user code of the env configs imported here, shipped by value
        self.generation = 0
        """Runner actors created so far: it changes whenever a runner is replaced (a push route's
        transfer group is then formed again)."""
        self._slots: dict[int, _RunnerSlot] = {}
        for index in range(self.num_runners):
            self._slots[index] = _RunnerSlot(actor=self._new_actor(index, counters[index]), started=counters[index])
        self._budgeted = spec.async_queue_size is not None
        """Whether training episodes start only as `grant()` allows (bounded staleness)."""
        self._streaming = False
        self._weights: tuple[int, Any] | None = None
        self._weight_calls: dict[Any, tuple[int, Any]] = {}
        """Pending async weight updates: ref -> (runner index, the actor it went to)."""
        self.num_restarts = 0
        self.num_lost_episodes = 0
        self.last_env_error: str | None = None
        """The latest env error any runner reported (`RunnerReport.last_env_error`); None if none came."""
        self._repeats: tuple[str, int] | None = None
        """(the last runner error that was not a death, how many times in a row it came)."""
        self.facts: dict[str, Any] = {}
        self.runner_facts: list[dict[str, Any]] = []
        """Every runner's setup facts (``facts`` is the first one's)."""
        self._weights_source: Callable[[], tuple[int, Any]] | None = None
        """Where a replacement runner gets its weights (``set_weights_source``); None: the last broadcast."""

    # ------------------------------------------------------------------------------------------
    def _new_actor(self, index: int, start_counter: int) -> Any:
        self.generation += 1
        return self._actor_cls.options(name=None).remote(
            Shipped(self._runner_spec),
            runner_index=index,
            num_runners=self.num_runners,
            model_path=self.model_path,
            start_counter=start_counter,
            env_spec=Shipped(self._env_spec),
        )

    def _get(self, refs: Any, what: str, timeout_s: float | None = None) -> Any:
        timeout = self.spec.sample_timeout_s if timeout_s is None else timeout_s
        try:
            return ray.get(refs, timeout=timeout)
        except GetTimeoutError as err:
            custom = getattr(self.spec, "custom_resources_per_env_runner", None)
            pinned = f", custom_resources_per_env_runner={dict(custom)}: a node must offer them" if custom else ""
            raise EnvRunnerGroupError(
                f"EnvRunners did not {what} within {timeout:g} s. If the cluster is small, check that "
                f"the actors' CPU requests fit (num_cpus_per_env_runner={self.spec.num_cpus_per_env_runner}"
                f"{pinned}); otherwise raise sample_timeout_s."
            ) from err

    def setup(self) -> dict[str, Any]:
        """Start every runner's engine; returns the first runner's facts (pad id, context length).

        Waits up to ``max(sample_timeout_s, ENGINE_START_TIMEOUT_S)``: an engine start (vLLM loading
        and warming up, minutes on a busy CPU host) is not bounded by an episode's sampling deadline.
        """
        facts = self._get(
            [slot.actor.setup.remote() for slot in self._slots.values()],
            "start their engines",
            timeout_s=max(self.spec.sample_timeout_s, ENGINE_START_TIMEOUT_S),
        )
        self.facts = facts[0]
        self.runner_facts = list(facts)
        return self.facts

    @property
    def transfer_workers(self) -> list[int]:
        """Per runner, its engine's workers (their ranks in a push route's transfer group)."""
        return [int(self.facts.get("num_transfer_workers", 1))] * len(self.actors)

    @property
    def transfer_devices(self) -> list[list[str]]:
        """Per runner, the GPUs its engine runs on (``<node>/<GPU id>``, from ``setup``; [] = CPU)."""
        return [list(f.get("transfer_devices", [])) for f in self.runner_facts]

    def set_weights_source(self, source: Callable[[], tuple[int, Any]] | None) -> None:
        """Where a replacement runner gets its weights: ``source()``, called at each restart.

        ``source`` returns ``(version, weights)``; None (the default) reloads the last
        ``broadcast_weights``. A push route, which broadcasts nothing, points it at the learners'
        current weights.
        """
        if source is not None and not callable(source):
            raise TypeError(
                f"set_weights_source: expected a callable () -> (version, weights) or None; got "
                f"{type(source).__name__}. Fix: pass a function, e.g. lambda: (version, buckets)."
            )
        self._weights_source = source

    def check_alive(self, timeout_s: float = 60.0) -> int:
        """Ping every runner; restart those that died (their replacements load the current weights).

        A push route calls this before each transfer: a dead member would leave the others waiting
        inside the collective. A replacement joins the next transfer when Ray places it within
        `PLACEMENT_WAIT_S`, else a later one. Returns how many runners were restarted.
        """
        self._check_weight_calls()
        self.place_waiting()
        pings = {index: slot.actor.ping.remote() for index, slot in self._live().items()}
        restarted = 0
        for index, ref in pings.items():
            try:
                self._get(ref, "answer a ping", timeout_s=timeout_s)
            except RayError as err:
                self._restart(index, err)
                restarted += 1
        waiting = [slot.placing for slot in self._slots.values() if slot.placing is not None]
        if restarted and waiting:
            ray.wait(waiting, num_returns=len(waiting), timeout=PLACEMENT_WAIT_S)
            self.place_waiting()
        return restarted

    @property
    def actors(self) -> list[Any]:
        """The running runners' actors, by index (a replacement waiting for a node is not one of them)."""
        return [slot.actor for slot in self._live().values()]

    def _live(self) -> dict[int, _RunnerSlot]:
        """The runners that run: all but the replacements Ray has not placed yet."""
        return {index: slot for index, slot in self._slots.items() if slot.placing is None}

    @property
    def num_healthy(self) -> int:
        """Runners running now (`env_runners/num_healthy`); below `num_runners` while a replacement waits
        for a node with room."""
        return len(self._live())

    @property
    def started_counters(self) -> list[int]:
        """Per runner index, the training episodes started so far (the async data cursor)."""
        return [self._slots[i].started for i in range(self.num_runners)]

    @property
    def in_flight(self) -> int:
        return sum(slot.in_flight + slot.buffered for slot in self._slots.values())

    def set_counters(self, counters: Sequence[int]) -> None:
        """Move every runner's prompt cursor (resume); only before `start_streaming()`."""
        if self._streaming:
            raise EnvRunnerGroupError("set_counters() must come before start_streaming().")
        if len(counters) != self.num_runners:
            raise EnvRunnerGroupError(
                f"Expected one prompt cursor per env runner ({self.num_runners}); got {len(counters)}. "
                "Resume with the same num_env_runners as the checkpoint."
            )
        self._get([self._slots[i].actor.set_counter.remote(int(c)) for i, c in enumerate(counters)], "reset")
        for i, c in enumerate(counters):
            self._slots[i].started = int(c)
            self._slots[i].granted = None

    @property
    def streaming(self) -> bool:
        return self._streaming

    # ------------------------------------------------------------------------------------------
    # weights
    # ------------------------------------------------------------------------------------------
    def broadcast_weights(self, version: int, weights_ref: Any, *, wait: bool = False) -> float:
        """Send the weights to every runner; returns seconds spent.

        `weights_ref` is a `WeightBuckets` of object refs (the learners' `PutBuckets` answer: each
        runner fetches and loads one bucket at a time, so no runner holds a full copy) or one
        object ref of a full state dict (Ray resolves it before the call runs: a full copy per
        runner). The same object goes to every runner and is kept for restarts: a replacement runner
        loads it before its first episode.

        With `wait=False` (async mode) the runners load the weights while they keep sampling and this
        returns at once; errors surface at the next call. `wait=True` blocks until all have loaded.
        """
        start = time.perf_counter()
        self._weights = (int(version), weights_ref)
        self._check_weight_calls()
        self.place_waiting()
        live = self._live()  # a replacement still waiting for a node loads the weights once it starts
        calls = [slot.actor.weight_sync.remote(LoadWeights(int(version), weights_ref)) for slot in live.values()]
        if wait:
            self._settle(dict(zip(live, calls)), "load new weights")
        else:
            self._weight_calls.update(
                {ref: (index, slot.actor) for ref, (index, slot) in zip(calls, live.items())}
            )
        return time.perf_counter() - start

    def sleep_engines(self) -> None:
        """Every runner's engine frees its GPU for a colocated learner's update (vLLM sleep mode)."""
        self._settle({i: slot.actor.sleep_engine.remote() for i, slot in self._live().items()}, "sleep their engines")

    def wake_engines(self) -> None:
        """Wake the engines that no weight update woke (sleep mode); a replacement runner starts awake."""
        self._settle({i: slot.actor.wake_engine.remote() for i, slot in self._live().items()}, "wake their engines")

    def _check_weight_calls(self) -> None:
        """Restart the runners whose earlier weight update failed (a dead actor shows up here first)."""
        if not self._weight_calls:
            return
        refs = list(self._weight_calls)
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        for ref in done:
            index, actor = self._weight_calls.pop(ref)
            try:
                self._get(ref, "load new weights", timeout_s=0)
            except RayError as err:
                if self._slots[index].actor is actor:  # not yet replaced through a failed poll
                    self._restart(index, err)

    def _settle(self, calls: dict[int, Any], what: str) -> None:
        """Wait for `calls` (runner index -> its call); restart runners whose call failed (a replacement
        loads the current weights when it starts, `_admit`)."""
        for index, ref in calls.items():
            try:
                self._get(ref, what)
            except RayError as err:
                self._restart(index, err)

    # ------------------------------------------------------------------------------------------
    # the async stream
    # ------------------------------------------------------------------------------------------
    def start_streaming(self, allowed: int | None = None) -> None:
        """Every runner starts playing episodes and keeps K in flight.

        Args:
            allowed: with an admission budget (`async_queue_size`), how many training episodes the
                runners may have started in total (see `grant`).
        """
        self._streaming = True
        for index in self._live():
            self._start_slot(index)
        if allowed is not None:
            self.grant(allowed)

    def _start_slot(self, index: int, weights: tuple[int, Any] | None = None) -> None:
        """Start runner `index` streaming; `weights` (default the last broadcast) load before its first episode."""
        slot = self._slots[index]
        if self._budgeted and slot.granted is None:
            slot.granted = slot.started
        weights = weights if weights is not None else self._weights
        version, weights = weights if weights is not None else (None, None)
        # One call: a separate LoadWeights could land after the stream started (async actors do not
        # run calls in order, and this one waits for its weights to be fetched first).
        slot.actor.start.remote(version, weights, slot.granted)
        slot.poll = slot.actor.poll.remote(self.spec.train_batch_size, POLL_TIMEOUT_S)

    @property
    def granted(self) -> int:
        """Training episodes the runners may start in total (their data cursors' limits)."""
        return sum(slot.granted if slot.granted is not None else slot.started for slot in self._slots.values())

    def grant(self, allowed: int) -> None:
        """Raise the runners' start limits until, together, they may have started `allowed` episodes.

        The extra allowance goes one episode at a time to the runner with the fewest granted but not
        yet started episodes (a runner that keeps up gets more). Limits only grow; a call that
        allows nothing new sends nothing.
        """
        if not self._budgeted:
            return
        extra = int(allowed) - self.granted
        if extra <= 0:
            return
        unused = {index: slot.granted - slot.started for index, slot in self._live().items()}
        if not unused:  # every runner waits for a node: the allowance goes to them once they start
            return
        raised: set[int] = set()
        for _ in range(extra):
            index = min(unused, key=lambda i: (unused[i], i))
            unused[index] += 1
            self._slots[index].granted += 1
            raised.add(index)
        for index in sorted(raised):
            slot = self._slots[index]
            slot.actor.set_start_limit.remote(slot.granted)  # fire and forget: a death shows in poll

    def next_reports(self, timeout_s: float) -> list[RunnerReport]:
        """Reports of the runners that have answered, waiting up to `timeout_s` for the first."""
        if not self._streaming:
            raise EnvRunnerGroupError("start_streaming() first (sync_group mode uses sample()).")
        self.place_waiting()
        polls = {slot.poll: index for index, slot in self._live().items()}
        waiting = [slot.placing for slot in self._slots.values() if slot.placing is not None]
        ready, _ = ray.wait([*polls, *waiting], num_returns=1, timeout=timeout_s)  # a placement wakes it too
        if ready and polls:
            ready, _ = ray.wait(list(polls), num_returns=len(polls), timeout=0)
        else:
            ready = []
        reports = []
        for ref in ready:
            index = polls[ref]
            try:
                report = self._get(ref, "report", timeout_s=timeout_s)
            except RayError as err:
                self._restart(index, err)
                continue
            self._book(index, report)
            reports.append(report)
            slot = self._slots[index]
            slot.poll = slot.actor.poll.remote(self.spec.train_batch_size, POLL_TIMEOUT_S)
        self.place_waiting()
        return reports

    def _book(self, index: int, report: RunnerReport) -> None:
        self._repeats = None  # a runner works again: an earlier error was not the run's fate
        if report.last_env_error is not None:
            self.last_env_error = report.last_env_error
        slot = self._slots[index]
        slot.started = report.started
        slot.in_flight = report.in_flight
        slot.buffered = report.buffered

    # ------------------------------------------------------------------------------------------
    # on-demand sampling (sync_group, evaluation)
    # ------------------------------------------------------------------------------------------
    def sample(
        self, indices: Sequence[int], *, group_size: int, evaluation: bool = False, split: str | None = None
    ) -> list[RunnerReport]:
        """Play `group_size` episodes for each prompt index, spread over the runners; wait for all.

        `evaluation` and `split` as in `EnvRunner.sample`: an episode depends on its index, replica
        and the weights only, so the split of the indices among the runners changes nothing.
        """
        self.place_waiting()
        if not self._live():
            self._placed_runner(next(iter(self._slots)), 0.0)  # waits for one, or raises
        live = list(self._live())  # a replacement waiting for a node gets no share
        shares = {index: list(indices[k :: len(live)]) for k, index in enumerate(live)}
        options = {"group_size": group_size, "evaluation": evaluation, "split": split}
        calls = {
            index: self._slots[index].actor.sample.remote(share, **options)
            for index, share in shares.items()
            if share
        }
        reports = []
        for index, ref in calls.items():
            try:
                reports.append(self._get(ref, "finish their episodes"))
            except RayError as err:
                self._restart(index, err, lost=len(shares[index]) * group_size)
                runner = self._slots[self._placed_runner(index, PLACEMENT_WAIT_S)]
                reports.append(self._get(runner.actor.sample.remote(shares[index], **options), "finish their episodes"))
        return reports

    def evaluation_size(self, split: str | None = None) -> int | None:
        """Tasks in the split's evaluation env when it is a finite list, else None (asks a running runner)."""
        runner = self._slots[self._placed_runner(next(iter(self._slots)), 0.0)]
        return self._get(runner.actor.evaluation_size.remote(split), "make the evaluation env")

    # ------------------------------------------------------------------------------------------
    # failures
    # ------------------------------------------------------------------------------------------
    def _restart(self, index: int, err: BaseException, *, lost: int | None = None) -> None:
        slot = self._slots[index]
        lost = slot.in_flight + slot.buffered if lost is None else lost
        self.num_lost_episodes += lost
        if not self.spec.restart_failed_env_runners:
            raise EnvRunnerGroupError(
                f"EnvRunner {index} failed ({err!r}); restart_failed_env_runners is False."
            ) from err
        self._stop_on_a_repeated_error(index, err)
        if self.num_restarts >= self.spec.max_num_env_runner_restarts:
            raise EnvRunnerGroupError(
                f"EnvRunner {index} failed ({err!r}) after {self.num_restarts} restarts "
                f"(max_num_env_runner_restarts={self.spec.max_num_env_runner_restarts})."
            ) from err
        self.num_restarts += 1
        logger.warning(
            "EnvRunner %d died (%s); restarting it, %d in-flight episodes lost (%d restarts so far).",
            index, type(err).__name__, lost, self.num_restarts,
        )
        ray.kill(slot.actor, no_restart=True)
        # The new runner replays the data cursor from the last report on: the episodes started after
        # it were never reported, so they are neither lost nor granted any more.
        new = _RunnerSlot(
            actor=self._new_actor(index, slot.started),
            started=slot.started,
            granted=slot.started if slot.granted is not None else None,
        )
        new.placing, new.placing_since = new.actor.ping.remote(), time.monotonic()
        self._slots[index] = new
        self.place_waiting()  # it starts once Ray has placed it: now, at a later poll, or when a node joins

    # ------------------------------------------------------------------------------------------
    # elastic runners: replacements that wait for a node
    # ------------------------------------------------------------------------------------------
    def place_waiting(self) -> None:
        """Start the replacements Ray has placed since the last call (without waiting for any); say once
        of each that waits longer than `PLACEMENT_WAIT_S` that the run goes on without it."""
        waiting = {slot.placing: index for index, slot in self._slots.items() if slot.placing is not None}
        if not waiting:
            return
        ready, _ = ray.wait(list(waiting), num_returns=len(waiting), timeout=0)
        for ref in ready:
            self._admit(waiting[ref], ref)
        now = time.monotonic()
        for index, slot in self._slots.items():
            if slot.placing is not None and not slot.announced and now - slot.placing_since >= PLACEMENT_WAIT_S:
                slot.announced = True
                logger.warning(
                    "EnvRunner %d cannot be placed: no node has room for it (num_cpus=%g, num_gpus=%g, custom "
                    "resources %s); training goes on with %d of %d env runners (env_runners/num_healthy), and it "
                    "starts when a node with room joins.",
                    index, self.spec.num_cpus_per_env_runner, self.spec.num_gpus_per_env_runner,
                    dict(self.spec.custom_resources_per_env_runner), self.num_healthy, self.num_runners,
                )

    def _admit(self, index: int, ping: Any) -> None:
        """Replacement `index` answered its ping (`ping`, ready): it streams, or loads the current weights."""
        slot = self._slots[index]
        if slot.placing is not ping:  # admitted already (a nested call), or replaced meanwhile
            return
        slot.placing = None
        try:
            self._get(ping, "answer a ping", timeout_s=0)
        except RayError as err:  # its node left before it answered, or its constructor raised
            self._restart(index, err)
            return
        self.generation += 1  # one more running actor: a push route forms its transfer group again
        if slot.announced:
            logger.warning("EnvRunner %d was placed and starts: %d of %d env runners running.",
                           index, self.num_healthy, self.num_runners)
        weights = self._weights_source() if self._weights_source is not None else self._weights
        if self._streaming:
            self._start_slot(index, weights)  # loads the current weights before its first episode
        elif weights is not None:
            try:  # before its first sample() (an async actor may interleave a later call with the load)
                self._get(slot.actor.weight_sync.remote(LoadWeights(*weights)), "load weights")
            except RayError as err:
                self._restart(index, err)

    def _placed_runner(self, prefer: int, timeout_s: float) -> int:
        """A running runner for the work of runner `prefer` (just replaced, or any): `prefer` once Ray places
        it within `timeout_s`, else another running one; with none running, the first placed within
        `sample_timeout_s`, else an error."""
        slot = self._slots[prefer]
        if slot.placing is not None and timeout_s > 0:
            ray.wait([slot.placing], num_returns=1, timeout=timeout_s)
        self.place_waiting()
        if not self._live():
            waiting = [s.placing for s in self._slots.values() if s.placing is not None]
            ray.wait(waiting, num_returns=1, timeout=self.spec.sample_timeout_s)
            self.place_waiting()
        live = self._live()
        if not live:
            spec = self.spec
            raise EnvRunnerGroupError(
                f"No env runner runs: none of the {self.num_runners} replacements was placed within "
                f"sample_timeout_s={spec.sample_timeout_s:g} s. Expected a node with room for one (num_cpus="
                f"{spec.num_cpus_per_env_runner:g}, num_gpus={spec.num_gpus_per_env_runner:g}, custom resources "
                f"{dict(spec.custom_resources_per_env_runner)}). Fix: bring a node back or add one (ray start "
                "--address ...), or lower the runners' requests."
            )
        return prefer if prefer in live else next(iter(live))

    def _stop_on_a_repeated_error(self, index: int, err: BaseException) -> None:
        """An error raised by the runner's code (not its death) that repeats is deterministic, e.g. an env
        whose constructor or reset always raises: restarting (and starting its engine again) cannot help.
        One the runner itself declares deterministic (`EnvErrorStreak`) stops the run at once."""
        if is_death(err):
            self._repeats = None  # killed, out of memory, worker crashed, node or object lost: restarting cures it
            return
        cause = err.cause if isinstance(err, RayTaskError) and err.cause is not None else err
        if isinstance(cause, EnvErrorStreak):
            raise EnvRunnerGroupError(f"EnvRunner {index} stopped the run: {cause}") from err
        signature = f"{type(cause).__name__}: {cause}".split("\n")[0]
        count = self._repeats[1] + 1 if self._repeats is not None and self._repeats[0] == signature else 1
        self._repeats = (signature, count)
        if count >= REPEATED_ERROR_LIMIT:
            raise EnvRunnerGroupError(
                f"EnvRunner {index} failed with the same error {count} times in a row: {signature}. Expected "
                "restarts to cure a crash; an error that repeats is in the settings or the env (its "
                "constructor, reset or data). Fix it; the run stops instead of restarting again."
            ) from err

    def kill(self, index: int) -> None:
        """Kill runner `index` (fault-injection for tests and drills); the group restarts it.

        Returns once the runner is dead (`kill_and_confirm`): a `check_alive` right after finds it.
        """
        kill_and_confirm(self._slots[index].actor)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop every runner (engines closed) and kill the actors."""
        self._streaming = False
        stops = [slot.actor.stop.remote() for slot in self._live().values()]  # one waiting for a node: killed
        try:
            ray.get(stops, timeout=timeout_s)
        except RayError as err:  # a runner that died (of any cause) or hangs: it is killed below either way
            logger.warning("Some env runners did not stop cleanly: %r", err)
        for slot in self._slots.values():
            ray.kill(slot.actor, no_restart=True)
        self._slots.clear()


def is_death(err: BaseException) -> bool:
    """Whether ``err`` says a runner's process or its data went away (restarting cures it), not that its code raised.

    Every ``RayError`` but a task's own error (``RayTaskError``), an actor whose constructor raised
    (``actor_init_failed``) and a timeout: ``ActorDiedError``, ``WorkerCrashedError``,
    ``OutOfMemoryError``, ``NodeDiedError``, ``ObjectLostError`` and their kin.
    """
    if not isinstance(err, RayError) or isinstance(err, (RayTaskError, GetTimeoutError)):
        return False
    return not (isinstance(err, RayActorError) and err.actor_init_failed)


def _driver_env_spec(env_id: str) -> Any:
    """The driver's Gymnasium EnvSpec of `env_id`: the runners make their envs from it.

    The id is registered where the run is built (the algorithm's config registers the flashrl/* ids
    when it validates; a user's own id is registered by the user's script), so the actors need not
    import the module that registered it, nor the env's own module: a user's "module:Class" entry point
    is imported here and the class travels by value (`env_check.runner_env_spec`, `flashrl.user_code`);
    flashrl's own entry points are imported by the runners.
    """
    import gymnasium as gym

    try:
        return runner_env_spec(env_id)
    except gym.error.Error as err:
        raise ValueError(
            f"env: expected an id registered with Gymnasium in this process, got {env_id!r} ({err}). Fix: "
            "import the module that registers it first (e.g. `import flashrl.envs`), or gymnasium.register it."
        ) from err
