"""`EnvRunner`: one inference engine, many environment instances, a stream of finished episodes.

An EnvRunner keeps up to K episodes in flight at once (asyncio tasks; the engine batches their
generation requests) and buffers every finished episode until the algorithm polls for it. One episode
per prompt, no groups: an episode is delivered as soon as it ends, whatever the others do. New
weights are loaded while sampling goes on; each model turn records the policy version that produced
it (`Episode.policy_versions`), so the learner knows the lag of every trajectory.

Episodes that cannot be trained on are dropped and counted, never silently and never as a crash:
non-finite rewards or log-probs, log-probs above 0, a turn the engine aborted, no generated token,
longer than the context budget, a request the engine rejects, an environment that raised or returned
text the tokenizer cannot encode (see `RUNNER_SKIP_REASONS`). Env calls (reset, step, close) run in a
thread pool within ``env_timeout_s``, never on the event loop; the same env error in
`ENV_ERROR_LIMIT` episodes in a row stops the run with its traceback (`flashrl.env_runners.env_errors`). An engine failure is fatal: the next `poll` raises it and the
`EnvRunnerGroup` restarts the actor.

Every episode is played by the runner's one `Rollout` (`flashrl.env_runners.rollout_protocol`), chosen
when the runner makes its first env from the kind the env declares: a stepped env is played with the
engine (``"gym"``, `flashrl.env_runners.rollout`); an agent env (``flashrl/Agent-v0``) runs its agent
program against the runner's OpenAI-compatible endpoint (``"agent"``, `flashrl.env_runners.agent_rollout`;
one endpoint per sampling setting, started on first use and stopped by `stop`).

The user's callbacks (`flashrl.callbacks`) fire here: `on_episode_end` for each episode that will be
delivered, `on_sample_end` for each hand-out (a poll with episodes, a `sample()` call); what they
log travels in the next `RunnerReport` (`callback_metrics`).

The class is a plain Python class (tests drive it in-process); `EnvRunnerGroup` wraps it in a Ray
actor (`ray.remote(EnvRunner)`; all its public methods are coroutines, so it is an async actor).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, defaultdict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym

from flashrl.callbacks import MetricsLogger, make_callbacks
from flashrl.env_runners.data_passes import DataPasses
from flashrl.env_runners.env_errors import (
    EnvBoundary,
    EnvErrorBooks,
    EnvErrorRecord,
    agent_name,
    error_signature,
    user_traceback,
)
from flashrl.env_runners.evaluation import split_env_config
from flashrl.env_runners.rollout import evaluation_reset_options, finite_task_count, skip_reason
from flashrl.env_runners.rollout_protocol import (
    EnvError,
    EnvTimeout,
    Rollout,
    RolloutContext,
    RolloutLimits,
    declared_kind,
    failure_kind,
    in_thread,
)
from flashrl.env_runners.rollouts import rollout_class
from flashrl.env_runners.spec import EnvRunnerSpec
from flashrl.env_runners.types import EVAL_STREAM, TRAIN_STREAM, RunnerReport
from flashrl.episode import Episode
from flashrl.seeds import stream_seed
from flashrl.weight_sync.buckets import Weights
from flashrl.weight_sync.endpoints import WeightInbox
from flashrl.weight_sync.layout import gpu_slots
from flashrl.weight_sync.messages import LoadWeights
from flashrl.weight_sync.receiver import RunnerMessage

logger = logging.getLogger("flashrl.env_runners")


class EnvRunner:
    """Hosts one engine and up to K concurrent episodes; see the module docstring.

    Args:
        spec: what the runner needs of the run (`algorithm_config.env_runner_spec()`).
        runner_index: stable index of this runner (its seeds and its share of the prompt stream).
        num_runners: how many runners share the training prompt stream.
        model_path: local Hugging Face folder of the initial policy.
        start_counter: training episodes this runner index already started (resume / restart).
        env_spec: the driver's `gymnasium.EnvSpec` of `spec.env`; lets envs registered only in the
            driver script (e.g. a class defined in `__main__`) be made in the actor.
    """

    def __init__(
        self,
        spec: EnvRunnerSpec,
        *,
        runner_index: int,
        num_runners: int,
        model_path: str,
        start_counter: int = 0,
        env_spec: gym.envs.registration.EnvSpec | None = None,
    ) -> None:
        if not isinstance(spec, EnvRunnerSpec):
            raise TypeError(
                f"EnvRunner: expected an EnvRunnerSpec, got {type(spec).__name__}. Fix: pass "
                "config.env_runner_spec() (or EnvRunnerSpec.from_dict(...) for a plain dict)."
            )
        self.spec = spec
        logging.getLogger("flashrl").setLevel(self.spec.log_level)
        self.runner_index = int(runner_index)
        self.num_runners = int(num_runners)
        self.model_path = model_path
        self._counter = int(start_counter)
        self._context = self.spec.max_episode_tokens
        self._env_spec = env_spec
        self._engine: Any = None
        self._pools: dict[tuple[int, str | None], list[gym.Env]] = defaultdict(list)
        """Idle env instances per (stream, evaluation split)."""
        self._executor = self._new_executor()
        self._env_errors = EnvErrorBooks()
        """This runner's streak of identical env errors (`flashrl.env_runners.env_errors`)."""
        self._buffer: deque[Episode] = deque()
        self._tasks: set[asyncio.Task[_Outcome]] = set()
        self._stream_task: asyncio.Task[None] | None = None
        self._changed: asyncio.Event | None = None
        self._arrived: asyncio.Event | None = None
        self._fatal: BaseException | None = None
        self.weight_inbox = WeightInbox(lambda: self._engine, ready=self.setup, on_abort=self._transfer_aborted)
        """This runner's side of weight sync (`flashrl.weight_sync.endpoints`): every transport's receiver."""
        self._accounts = _Accounts()  # the stream's, since the last poll
        self._start_limit: int | None = None
        """No training episode starts once the data cursor reaches it (None = no limit)."""
        self._passes: DataPasses | None = None
        """The training set's passes (a finite task list; `flashrl.env_runners.data_passes`); None for an
        infinite source. Read from the first training env (an evaluation-only runner, `flashrl eval`,
        never builds one)."""
        self._passes_read = False
        self.callbacks = make_callbacks(spec.callbacks_class)
        """This actor's instance of the user's callbacks (`flashrl.callbacks`)."""
        self._rollout: Rollout | None = None
        """How this runner plays every episode (`flashrl.env_runners.rollouts`), chosen once, when it makes
        its first env, from the kind the env declares (`declared_kind`)."""

    # ------------------------------------------------------------------------------------------
    # lifecycle
    # ------------------------------------------------------------------------------------------
    async def setup(self) -> dict[str, Any]:
        """Start the engine (idempotent); returns facts the algorithm needs (pad id, context length)."""
        if self._engine is None:
            from flashrl.engines import make_engine
            from flashrl.plan import runner_engine_options

            self._changed = asyncio.Event()
            self._arrived = asyncio.Event()
            # the run plan's engine options (flashrl.plan): the driver's spec carries them; a spec made
            # without a plan gets the same (context and sequences from the run, not the model's defaults)
            options = runner_engine_options(self.spec)
            self._engine = make_engine(
                self.spec.engine,
                self.model_path,
                seed=stream_seed(self.spec.seed, 7, self.runner_index),
                **options,
            )
        self._context = min(self.spec.max_episode_tokens, int(self._engine.max_model_len))
        tok = self._engine.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        return {
            "pad_token_id": int(pad if pad is not None else 0),
            "max_model_len": int(self._engine.max_model_len),
            "engine_version": int(self._engine.version),
            # the route new weights take: "shm" (streamed buckets, pulled) unless a vLLM engine on a
            # GPU was started with a push route ("nccl" / "ipc", driven by the learner)
            "weight_sync": str(getattr(self._engine, "weight_sync", "shm")),
            "num_transfer_workers": int(getattr(self._engine, "num_transfer_workers", 1)),
            # the names the engine loads: its own model's state dict, or (vLLM) the checkpoint's
            "weight_names": str(getattr(self._engine, "weight_names", "model")),
            # the GPUs Ray gave this runner (its engine's workers run there): a push route is checked
            # against them (flashrl.weight_sync.layout.check_route)
            "transfer_devices": list(gpu_slots()),
        }

    async def start(
        self,
        version: int | None = None,
        weights: Weights | None = None,
        start_limit: int | None = None,
    ) -> None:
        """Begin streaming training episodes (async mode).

        Args:
            version, weights: the learner's current weights, loaded before the first episode starts
                (a restarted runner must not sample with its initial weights).
            start_limit: see `set_start_limit`.
        """
        await self.setup()
        if start_limit is not None:
            await self.set_start_limit(start_limit)
        if weights is not None:
            await self.weight_sync(LoadWeights(int(version or 0), weights))
        if self._stream_task is None:
            self._stream_task = asyncio.get_running_loop().create_task(self._stream())

    async def set_start_limit(self, limit: int | None) -> None:
        """Start training episodes only while this runner's data cursor is below `limit`.

        The algorithm's admission budget (`async_queue_size`): the limit only grows, so grants that
        arrive out of order are harmless; None removes it.
        """
        if limit is None or self._start_limit is None:
            self._start_limit = limit
        else:
            self._start_limit = max(self._start_limit, int(limit))
        if self._changed is not None:
            self._changed.set()

    async def stop(self) -> None:
        """Cancel in-flight episodes and release the engine; later weight pushes are ignored."""
        self.weight_inbox.close()
        if self._stream_task is not None:
            self._stream_task.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self._rollout is not None:
            await self._rollout.close()  # an agent rollout's endpoints
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        envs = [env for pool in self._pools.values() for env in pool]
        for pool in self._pools.values():
            pool.clear()
        await asyncio.gather(*(self._close_env(env) for env in envs))
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def ping(self) -> int:
        return self.runner_index

    async def set_counter(self, counter: int) -> None:
        """Move the training prompt cursor (resume); only before streaming starts."""
        if self._stream_task is not None:
            raise RuntimeError("set_counter() must come before start(): the stream is already running.")
        self._counter = int(counter)

    # ------------------------------------------------------------------------------------------
    # weights
    # ------------------------------------------------------------------------------------------
    async def weight_sync(self, message: RunnerMessage) -> Any:
        """One weight-sync message (`flashrl.weight_sync`), handed to this runner's receiver of its transport.

        The driver's group sends `LoadWeights` (a full ``{name: tensor}`` dict or a ``WeightBuckets``
        stream, fetched one bucket at a time while sampling goes on; calls coalesce to the newest
        version and answer the version now served, -1 once stopped); learner rank 0 sends a push
        transport's begin / receive / end / abort (`flashrl.weight_sync.vllm_push`).
        """
        return await self.weight_inbox.handle(message)

    def _transfer_aborted(self, reason: str) -> None:
        """A pushed transfer was aborted: the next poll raises, so the group restarts this runner."""
        if self._fatal is None:
            self._fatal = RuntimeError(
                f"EnvRunner {self.runner_index}: a pushed weight transfer was aborted ({reason})"
            )
        if self._arrived is not None:
            self._arrived.set()  # a poll waiting for episodes returns and raises

    async def sleep_engine(self) -> None:
        """Colocated learner's update ahead: the engine frees its GPU memory (vLLM sleep mode) and
        generation waits until the next weight update or ``wake_engine``."""
        await self.setup()
        async with self.weight_inbox.lock:
            await self._engine.sleep()

    async def wake_engine(self) -> None:
        """Wake the engine if no weight update woke it (a skipped update); an awake engine: nothing."""
        await self.setup()
        async with self.weight_inbox.lock:
            await self._engine.wake_up()

    # ------------------------------------------------------------------------------------------
    # the async stream
    # ------------------------------------------------------------------------------------------
    async def poll(self, max_episodes: int, timeout_s: float) -> RunnerReport:
        """Finished episodes (up to `max_episodes`, waiting up to `timeout_s` for the first one)."""
        await self.setup()
        assert self._arrived is not None and self._changed is not None
        if self._fatal is not None:
            raise self._fatal
        if not self._buffer:
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), timeout=timeout_s)
            except asyncio.TimeoutError:  # noqa: UP041 - not the builtin TimeoutError before Python 3.11
                pass
            if self._fatal is not None:
                raise self._fatal
        episodes = [self._buffer.popleft() for _ in range(min(max_episodes, len(self._buffer)))]
        self._changed.set()  # buffer space freed: the stream may start new episodes
        if episodes:
            self.callbacks.on_sample_end(
                env_runner=self, metrics_logger=self._accounts.metrics, samples=episodes, is_evaluation=False
            )
        report = self._report(episodes, self._accounts)
        self._accounts = _Accounts()
        return report

    def _report(self, episodes: list[Episode], accounts: _Accounts) -> RunnerReport:
        return RunnerReport(
            runner_index=self.runner_index,
            episodes=episodes,
            in_flight=len(self._tasks),
            buffered=len(self._buffer),
            started=self._counter,
            skipped=accounts.skipped,
            generated_tokens=accounts.generated_tokens,
            engine_version=int(self._engine.version),
            env_steps=accounts.env_steps,
            callback_metrics=accounts.metrics.state(),
            last_env_error=None if self._env_errors.last is None else self._env_errors.last.describe(),
        )

    async def _stream(self) -> None:
        assert self._changed is not None
        limit = self.spec.episodes_in_flight_per_env_runner
        max_buffered = self.spec.max_buffered_episodes
        sampling = self._sampling(self.spec.temperature)
        while self._fatal is None:
            self._changed.clear()
            # Back-pressure: no new episode while the buffer is full (bounds the policy lag).
            while (
                len(self._tasks) < limit
                and len(self._buffer) < max_buffered
                and (self._start_limit is None or self._counter < self._start_limit)
            ):
                index = self._counter * self.num_runners + self.runner_index
                self._counter += 1
                task = asyncio.get_running_loop().create_task(
                    self._play(index, TRAIN_STREAM, 0, sampling)
                )
                self._tasks.add(task)
                task.add_done_callback(self._on_done)
            await self._changed.wait()

    def _on_done(self, task: asyncio.Task[_Outcome]) -> None:
        assert self._changed is not None and self._arrived is not None
        self._tasks.discard(task)
        if task.cancelled():
            return
        err = task.exception()
        if err is not None:
            logger.error("EnvRunner %d: episode failed fatally: %r", self.runner_index, err)
            if self._fatal is None:  # the first cause stops the run; episodes already in flight may fail too
                self._fatal = err
            self._arrived.set()
        else:
            episode = self._accounts.book(task.result())
            if episode is not None:
                self._buffer.append(episode)
                self._arrived.set()
        self._changed.set()

    # ------------------------------------------------------------------------------------------
    # on-demand sampling (sync_group mode, evaluation)
    # ------------------------------------------------------------------------------------------
    async def sample(
        self,
        indices: list[int],
        *,
        group_size: int = 1,
        evaluation: bool = False,
        split: str | None = None,
    ) -> RunnerReport:
        """Play `group_size` episodes of each prompt index and wait for all of them.

        Args:
            indices: prompt indices (episode `i` resets its env with the stream's seed of `i`).
            group_size: replicas per index (sync_group's G, evaluation's samples per prompt).
            evaluation: the evaluation stream: its seeds, `evaluation_temperature` / `evaluation_top_p`,
                the env made from `env_config | evaluation_env_config | evaluation_splits[split]`.
            split: a name in `evaluation_splits` (None: no named split).
        """
        await self.setup()
        stream = EVAL_STREAM if evaluation else TRAIN_STREAM
        if evaluation:
            sampling = self._sampling(self.spec.evaluation_temperature, self.spec.evaluation_top_p)
        else:
            sampling = self._sampling(self.spec.temperature)
        self._check_split(split, evaluation)
        gate = asyncio.Semaphore(self.spec.episodes_in_flight_per_env_runner)
        accounts = _Accounts()  # kept apart from the stream's books

        async def one(index: int, replica: int) -> Episode | None:
            async with gate:
                return accounts.book(await self._play(index, stream, replica, sampling, split, accounts))

        results = await asyncio.gather(*(one(i, r) for i in indices for r in range(group_size)))
        episodes = [ep for ep in results if ep is not None]
        self.callbacks.on_sample_end(
            env_runner=self, metrics_logger=accounts.metrics, samples=episodes, is_evaluation=evaluation
        )
        return self._report(episodes, accounts)

    # ------------------------------------------------------------------------------------------
    # one episode
    # ------------------------------------------------------------------------------------------
    async def evaluation_size(self, split: str | None = None) -> int | None:
        """Tasks in the split's evaluation env when it is a finite list (evaluated once each), else None."""
        self._check_split(split, True)
        pool = self._pools[(EVAL_STREAM, split)]
        env = pool.pop() if pool else self._make_env(EVAL_STREAM, split)
        pool.append(env)
        return finite_task_count(env)

    def _check_split(self, split: str | None, evaluation: bool) -> None:
        if split is None:
            return
        if not evaluation or split not in self.spec.evaluation_splits:
            raise ValueError(
                f"split {split!r}: expected None or, with evaluation=True, one of the evaluation_splits "
                f"{sorted(self.spec.evaluation_splits)}. Fix: add it to evaluation_splits."
            )

    def _sampling(self, temperature: float, top_p: float | None = None) -> dict[str, Any]:
        return {
            "temperature": float(temperature),
            "top_p": float(self.spec.top_p if top_p is None else top_p),
            "top_k": int(self.spec.top_k),
            "max_tokens": int(self.spec.max_new_tokens),
        }

    def _make_env(self, stream: int, split: str | None = None) -> gym.Env:
        if stream == EVAL_STREAM:
            env_config = split_env_config(self.spec, split)
        else:
            env_config = dict(self.spec.env_config)
        env = EnvBoundary(gym.make(self._env_spec if self._env_spec is not None else self.spec.env, **env_config))
        if self._rollout is None:
            kind = declared_kind(type(env.unwrapped))
            self._rollout = rollout_class(kind, self.spec.env)(self.spec, self.runner_index)
        return env

    def _limits(self) -> RolloutLimits:
        """The runner's limits of an episode (the context budget as the engine allows it, `setup`)."""
        spec = self.spec
        return RolloutLimits(
            max_episode_tokens=self._context, max_turns=spec.max_turns,
            max_observation_tokens=spec.max_observation_tokens, env_timeout_s=spec.env_timeout_s,
            max_calls=spec.agent_max_calls, max_completion_tokens=spec.agent_max_completion_tokens,
            wall_time_s=float(spec.agent_wall_time_s),
        )

    def _new_executor(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(
            max_workers=max(2, self.spec.episodes_in_flight_per_env_runner),
            thread_name_prefix=f"env-runner-{self.runner_index}",
        )

    async def _close_env(self, env: gym.Env) -> None:
        """``env.close()`` in a worker thread with the env time limit: a close that hangs or raises must not
        block the event loop (every episode and poll of this runner runs on it) nor stop the runner."""
        try:
            await in_thread(self._executor, self.spec.env_timeout_s, env.close)
        except EnvTimeout as err:
            logger.warning("EnvRunner %d: env.close() abandoned: %s", self.runner_index, err)
            self._executor = self._new_executor()  # the hung close keeps its thread (see _play)
        except EnvError as err:
            logger.warning("EnvRunner %d: env.close() raised %s", self.runner_index, err)

    def _training_passes(self, env: gym.Env) -> DataPasses | None:
        if not self._passes_read:
            self._passes = DataPasses.for_env(
                finite_task_count(env), max_samples=self.spec.max_samples, seed=self.spec.seed
            )
            self._passes_read = True
        return self._passes

    async def _play(
        self,
        index: int,
        stream: int,
        replica: int,
        sampling: dict[str, Any],
        split: str | None = None,
        accounts: _Accounts | None = None,
    ) -> _Outcome:
        """Play one episode; the caller books the outcome (atomically with its in-flight count).

        ``accounts``: whose books the callbacks' metrics join (None: the stream's current ones, read
        when the episode ends, so a poll in between does not lose them)."""
        pool = self._pools[(stream, split)]
        env = pool.pop() if pool else self._make_env(stream, split)
        datasource = self.spec.evaluation_datasource_key
        reset_options, data = None, {}
        if stream == EVAL_STREAM:
            reset_options = evaluation_reset_options(env, index)
        elif self._training_passes(env) is not None:  # the training set's passes: the task by reset options
            data = {"data_pass": self._passes.position(index)[0], "task_index": self._passes.task_index(index)}
            reset_options = evaluation_reset_options(env, data["task_index"])
        assert self._rollout is not None  # chosen when the first env was made
        ctx = RolloutContext(
            env=env, engine=self._engine, run_seed=self.spec.seed, stream=stream, index=index, replica=replica,
            sampling=sampling, limits=self._limits(), executor=self._executor, reset_options=reset_options,
            keep_reset_info=(datasource,) if stream == EVAL_STREAM and datasource else (),
        )
        start = time.perf_counter()
        try:
            episode = await self._rollout.play(ctx)
        except Exception as err:
            kind = failure_kind(err)
            if kind is None:
                raise
            await self._dispose_failed(err, env, pool, index)
            return _Outcome(None, kind)
        pool.append(env)
        if episode is None:  # an agent that never called the model: not a success (env_errors docstring)
            streak = self._env_errors.empty(self._record(env, index, "no model call"))
            if streak is not None:
                raise streak  # deterministic: the run stops (EnvRunnerGroup does not restart it)
            return _Outcome(None, "empty")
        self._env_errors.success()
        tokens, turns = episode.num_generated_tokens, len(episode.policy_versions)
        reason = skip_reason(episode, max_episode_tokens=self.spec.max_episode_tokens)
        if reason is not None:
            return _Outcome(None, reason, tokens, turns)
        episode.info.update(
            {
                "episode_index": index,
                "replica": replica,
                "runner_index": self.runner_index,
                "duration_s": time.perf_counter() - start,
                **data,
            }
        )
        self.callbacks.on_episode_end(
            episode=episode,
            env_runner=self,
            metrics_logger=(accounts if accounts is not None else self._accounts).metrics,
            env=env,
            env_index=index,
            is_evaluation=stream == EVAL_STREAM,
            split=split,
        )
        return _Outcome(episode, None, tokens, turns)

    async def _dispose_failed(self, err: Exception, env: gym.Env, pool: list[gym.Env], index: int) -> None:
        """What becomes of the env (and the executor) after an episode failed with ``err`` (`failure_kind`)."""
        if isinstance(err, EnvTimeout):
            logger.warning("EnvRunner %d: episode %d dropped: %s", self.runner_index, index, err)
            if err.env_reusable:  # an agent cancelled: nothing of it runs on
                pool.append(env)
                return
            # The hung call still holds the env and one worker thread; neither close() (it could hang
            # too) nor reuse is safe. New episodes get a fresh executor, so they do not queue behind the
            # hung thread; the old one is not shut down (episodes in flight still submit to it) and
            # lets its idle threads go once the last of them drops it.
            self._executor = self._new_executor()
        elif isinstance(err, EnvError):
            cause = err.__cause__ if err.__cause__ is not None else err
            record = self._record(env, index, error_signature(cause), user_traceback(cause))
            await self._close_env(env)  # a broken env is not reused
            streak = self._env_errors.error(record)
            if streak is not None:
                raise streak from cause  # deterministic: the run stops (EnvRunnerGroup does not restart it)
        else:  # the engine rejected a request: the env is fine
            logger.warning("EnvRunner %d: request rejected in episode %d: %s", self.runner_index, index, err)
            pool.append(env)


    def _record(self, env: gym.Env, index: int, signature: str, text: str = "") -> EnvErrorRecord:
        """How an episode's failure is quoted: the env, its agent, the episode and its prompt id."""
        return EnvErrorRecord(
            env_id=str(self.spec.env), episode_index=index, prompt_id=getattr(env, "prompt_id", None),
            signature=signature, traceback=text, agent=agent_name(env),
        )


@dataclass
class _Outcome:
    """How one episode ended: delivered, or dropped with a reason."""

    episode: Episode | None
    skip_reason: str | None
    generated_tokens: int = 0
    env_steps: int = 0


@dataclass
class _Accounts:
    """Counts behind one report: dropped episodes by reason, generated tokens, env steps, callback metrics."""

    skipped: Counter[str] = field(default_factory=Counter)
    generated_tokens: int = 0
    env_steps: int = 0
    metrics: MetricsLogger = field(default_factory=MetricsLogger)

    def book(self, outcome: _Outcome) -> Episode | None:
        self.generated_tokens += outcome.generated_tokens
        self.env_steps += outcome.env_steps
        if outcome.skip_reason is not None:
            self.skipped[outcome.skip_reason] += 1
        return outcome.episode
