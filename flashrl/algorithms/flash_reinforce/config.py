"""`FlashReinforceConfig`: the RLlib-style chained builder for FlashREINFORCE.

The config is composed of the core's own specs, and each setting is declared (typed, with a one-line
docstring) and checked in exactly one of them:

- `EnvRunnerSpec` (`flashrl.env_runners.spec`): the env, the engines, sampling, evaluation episodes;
- `LearnerSpec` (`flashrl.learners.spec`): the model, the optimizer, micro-batching, the learner actors;
- `FlashReinforceLossSpec` (`learner_loss.py`): delta, the baseline and the other loss components;
- `FlashReinforceAlgorithmSpec` (below): what is the driver's own (rollout mode, evaluation schedule,
  reporting, checkpoints).

The config holds each part's values under the settings' own names, which are the flat names users,
the release's settings, `to_dict()` / `from_dict()`, checkpoints and Ray Tune's `param_space` use
(`config.lr`, `config.delta`); values are checked when `validate()` builds the parts (a Tune search
space such as `tune.grid_search([...])` may stand in for a value until then). The builder methods
carry RLlib's names (`.environment()`, `.env_runners()`, `.learners()`, `.training()`, ...), take
keyword-only settings of their section, each typed and documented (`builder_methods.py`), and return
`self`, so a run reads::

    config = (
        FlashReinforceConfig()
        .environment("flashrl/Math-v0", env_config={"preset": "easy_sums"})
        .env_runners(num_env_runners=2, engine="vllm")
        .training(model="smollm2-135m-instruct", train_batch_size=64, delta=0.01)
    )
    algo = config.build_algo()

`validate()` rejects impossible settings before any actor starts, every problem at once, each with
the expected value, the actual value and the fix; it keeps only the checks that span parts (the batch
size against the baseline and the rollout mode, the env id against the registry).
`validate_resources()` does the same for CPU/GPU requests that a Ray cluster cannot satisfy (Ray would
otherwise wait forever without an error).
"""

from __future__ import annotations

import copy
import difflib
import importlib
import re
import warnings
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any, ClassVar

from ray.tune.tune import _Config as _TuneConfig  # Tune takes any `_Config` as a `param_space`, as RLlib's

from flashrl.algorithms.flash_reinforce.builder_methods import BuilderMethods, NotProvided
from flashrl.algorithms.flash_reinforce.learner_loss import FlashReinforceLossSpec
from flashrl.callbacks import ship_by_value
from flashrl.env_runners.env_check import env_code_problems, env_config_problems, runner_env_spec
from flashrl.env_runners.spec import EnvRunnerSpec
from flashrl.env_runners.user_env import (
    FORMS,
    EnvRef,
    UserEnvError,
    class_spec,
    env_class,
    is_flashrl_entry_point,
)
from flashrl.framework_logging import LEVELS, valid_level
from flashrl.learners.spec import LearnerSpec
from flashrl.loggers import logger_problems
from flashrl.models.lora import VLLM_LORA_RANKS
from flashrl.user_code import UserCodeError, describe, is_description, is_path
from flashrl.validation import DERIVED, SECTION, Checks, SpecError, is_int, is_number, setting
from flashrl.weight_sync.layout import route_problem

ROLLOUT_MODES = ("async", "sync_group")
GROUP_BASELINES = ("group_mean", "group_norm")
"""Baselines over the G rollouts of one prompt: only meaningful in 'sync_group' mode."""


class ConfigError(ValueError):
    """An impossible or inconsistent setting; the message says expected, actual and the fix."""


@dataclass
class FlashReinforceAlgorithmSpec:
    """The settings that are the FlashREINFORCE driver's own (not the env runners', learners' or loss's)."""

    rollout_mode: str = setting("async", section="training", choices=ROLLOUT_MODES,
                                fix="use 'async' (the method)")
    """'async' (FlashREINFORCE: one rollout per prompt, never wait) or 'sync_group' (comparison)."""
    group_size: int = setting(8, section="training")
    """G rollouts per prompt in 'sync_group' mode (B/G prompts per batch); unused in 'async'."""
    num_epochs: int | None = setting(None, section="training", integer=True, ge=1, optional=True,
                                     fix="use None and set total_updates, or e.g. num_epochs=3")
    """Passes over a finite training set (Molt's train.num_episodes): the schedule's horizon (total_updates)
    becomes ceil(N / prompts per batch) x num_epochs, N the real set size after max_samples; None = set
    total_updates yourself."""
    evaluation_interval: int | None = setting(None, section="evaluation", integer=True, ge=1, optional=True,
                                              fix="use None to disable evaluation")
    """Evaluate every this many `train()` iterations; None = never automatically."""
    evaluation_num_samples_per_prompt: int = setting(1, section="evaluation", integer=True, ge=1)
    """k: episodes per evaluation prompt (avg@k = mean over prompts of the mean return of its k)."""
    evaluation_at_start: bool = setting(False, section="evaluation")
    """Also evaluate the initial policy, before the first update (step 0) of a fresh run."""
    metrics_num_episodes_for_smoothing: int = setting(100, section="reporting", integer=True, ge=1)
    """Episodes in the sliding window behind the smoothed `env_runners/*` metrics."""
    tensorboard: bool = setting(True, section="reporting")
    """Write TensorBoard scalars each iteration and histograms of drift, lengths and policy lag."""
    log_dir: str | None = setting(None, section="reporting")
    """TensorBoard folder; None = `<algo.output_dir>/tensorboard` (the trial's folder under Ray Tune)."""
    results_dir: str | None = setting(None, section="reporting")
    """Folder of `progress.csv` and `progress.jsonl` (one row per iteration, always written); None =
    `<algo.output_dir>/results`. The optional loggers' local files go there too."""
    loggers: list[str] = setting(default_factory=list, section="reporting")
    """Experiment trackers besides CSV, JSON lines and TensorBoard: 'wandb', 'mlflow' (the loggers extra)."""
    logger_options: dict[str, dict[str, Any]] = setting(default_factory=dict, section="reporting",
                                                          code="passthrough")
    """Per tracker, its options, e.g. {'wandb': {'project': 'math', 'mode': 'offline'}} (see flashrl.loggers)."""
    console_every: int = setting(1, section="reporting", integer=True, ge=0)
    """Print a one-line progress summary every this many iterations (and each evaluation); 0 = silent."""
    framework_log_level: str | None = setting("WARNING", section="reporting")
    """vLLM's and Ray's log level in driver and actors; WARNING+ drops known-harmless warnings; None = theirs (docs/runtime.md)."""
    rollout_dump_every: int = setting(0, section="reporting", integer=True, ge=0)
    """Write episodes of the batch as JSONL under `<log_dir>/rollouts/` every this many iterations; 0 = never."""
    rollout_dump_count: int = setting(4, section="reporting", integer=True, ge=1)
    """Episodes per rollout dump (the batch's first ones in arrival order; at most the batch)."""
    checkpoint_frequency: int = setting(0, section="checkpointing", integer=True, ge=0)
    """Save a checkpoint under checkpoint_dir every this many iterations; 0 = only when asked."""
    checkpoint_interval_minutes: float | None = setting(None, section="checkpointing", gt=0, optional=True,
                                                        fix="use None to save by iterations only")
    """Also save a periodic checkpoint after an iteration that ends this many minutes after the run's start or its
    last periodic save (whichever of this and checkpoint_frequency comes first); None = by iterations only."""
    checkpoint_dir: str | None = setting(None, section="checkpointing")
    """Where periodic checkpoints go (`<dir>/checkpoint_<iteration>`); None = `<algo.output_dir>/checkpoints`."""
    num_checkpoints_to_keep: int | None = setting(None, section="checkpointing", integer=True, ge=1,
                                                  optional=True, fix="use None to keep all")
    """Keep only the newest this many periodic checkpoints (by save time; `latest` names the newest); None = all."""
    checkpoint_export_policy: bool = setting(True, section="checkpointing")
    """Periodic checkpoints include the policy as a Hugging Face folder (`policy/`); False saves only what resumes."""
    max_failed_checkpoints: int = setting(3, section="checkpointing", integer=True, ge=1)
    """Stop the run when this many periodic saves in a row failed (disk full, I/O error); fewer: it trains on and
    retries at the next interval."""
    restart_failed_learners: bool = setting(True, section="learners")
    """When a learner actor dies or times out, start a new learner group and resume from the run's newest
    checkpoint (or its start); False stops the run with the cause (see docs/runtime.md, Faults)."""
    max_num_learner_restarts: int = setting(3, section="learners", integer=True, ge=0)
    """Stop the run (raise) instead of restarting the learner group more than this many times in one run."""
    num_cpus_for_main_process: float = setting(0.5, section="resources", ge=0)
    """Logical CPUs the algorithm's own process reserves under Ray Tune (the driver)."""

    def __post_init__(self) -> None:
        check = Checks("FlashReinforceAlgorithmSpec")
        check.fields(self)
        if self.rollout_mode == "sync_group":
            check.expect(is_int(self.group_size) and self.group_size >= 1, "group_size", "an integer >= 1",
                         self.group_size, "e.g. 8")
        check.expect(valid_level(self.framework_log_level), "framework_log_level", f"None or one of {LEVELS}",
                     self.framework_log_level, "e.g. 'INFO' to see vLLM's and Ray's INFO lines")
        check.expect(isinstance(self.evaluation_at_start, bool), "evaluation_at_start", "a bool",
                     self.evaluation_at_start, "use True to evaluate the initial policy")
        for name in ("log_dir", "checkpoint_dir"):  # written with os / torch: a URI would become a local folder
            value = getattr(self, name)
            check.expect(not (isinstance(value, str) and re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", value)),
                         name, "None or a local folder (one every node mounts, on a multi-node cluster)", value,
                         "give a URI to a tuned example's --output (the driver uploads there), or mount the storage")
        check.expect(isinstance(self.checkpoint_export_policy, bool), "checkpoint_export_policy", "a bool",
                     self.checkpoint_export_policy, "use False to skip the Hugging Face export of periodic saves")
        check.expect(isinstance(self.restart_failed_learners, bool), "restart_failed_learners", "a bool",
                     self.restart_failed_learners, "use False to stop the run when a learner actor dies")
        for problem in logger_problems(self.loggers, self.logger_options):
            check.add(problem)
        check.done()


_PARTS: dict[str, tuple[type, str | None]] = {
    "env_runners": (EnvRunnerSpec, "env_runners"),
    "learners": (LearnerSpec, "training"),
    "loss": (FlashReinforceLossSpec, "training"),
    "algorithm": (FlashReinforceAlgorithmSpec, None),
}
"""Part name -> (the class that declares and checks its settings, the default builder section)."""


def _index_settings() -> tuple[dict[str, str], dict[str, str]]:
    """setting name -> its part, and -> its builder section; a name declared twice is an error."""
    owners: dict[str, str] = {}
    sections: dict[str, str] = {}
    for part, (cls, default_section) in _PARTS.items():
        for f in fields(cls):
            if DERIVED in f.metadata:
                continue
            if f.name in owners:
                raise TypeError(f"the setting {f.name!r} is declared by both {owners[f.name]} and {part}: declare it once")
            owners[f.name] = part
            sections[f.name] = f.metadata.get(SECTION, default_section)
            if sections[f.name] is None:
                raise TypeError(f"{cls.__name__}.{f.name}: expected a section in its metadata")
    return owners, sections


_OWNERS, _SECTIONS = _index_settings()


def _defaults(part: str) -> dict[str, Any]:
    cls, _ = _PARTS[part]
    out = {}
    for f in fields(cls):
        if DERIVED not in f.metadata:
            out[f.name] = f.default_factory() if f.default is MISSING else copy.deepcopy(f.default)
    return out


def _normalized(name: str, value: Any) -> Any:
    """The builder's and from_dict's own copy of a value (dicts copied, betas a tuple)."""
    if name in ("env_config", "engine_options", "evaluation_env_config", "logger_options") and (
        value is None or isinstance(value, Mapping)
    ):
        return _copied(dict(value or {}))
    if name == "evaluation_splits" and (value is None or isinstance(value, Mapping)):
        return {str(k): _copied(dict(v)) if isinstance(v, Mapping) else v for k, v in (value or {}).items()}
    if name == "betas" and isinstance(value, list):
        return tuple(value)
    return _copied(value)


def _copied(value: Any) -> Any:
    """A deep copy in which user code (a callable: a component, a reward function, a class) is kept as it is."""
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copied(v) for v in value)
    return value if callable(value) else copy.deepcopy(value)


def _plain(value: Any, *, text: bool) -> Any:
    """``to_dict``'s form of a value (tuples as lists; user code, a callable, kept as it is) or, with
    ``text``, ``serialize``'s (user code as ``describe`` says)."""
    if isinstance(value, dict):
        return {k: _plain(v, text=text) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, text=text) for v in value]
    if callable(value):
        return describe(value) if text else value
    if text and isinstance(value, str):
        return str(value)  # an EnvRef's text
    return copy.deepcopy(value)


class FlashReinforceConfig(BuilderMethods, _TuneConfig):
    """Configuration of a FlashREINFORCE run; build it with the chained methods, then `build_algo()`.

    ``FlashReinforceConfig(**settings)`` sets settings by name too. Every setting reads and writes as
    an attribute (``config.delta = 0.003``); ``setting_names()`` lists them.
    """

    algo_class: ClassVar[str] = "flashrl.algorithms.flash_reinforce.algorithm:FlashReinforce"
    """The algorithm this config builds, by import path (as RLlib's ``AlgorithmConfig.algo_class``).
    Named, not imported: the algorithm module imports this one, and the modules form no cycle."""

    def __init__(self, **settings: Any) -> None:
        object.__setattr__(self, "_values", {part: _defaults(part) for part in _PARTS})
        for name, value in settings.items():
            setattr(self, name, _normalized(name, value))

    # ------------------------------------------------------------------------------------------------
    # settings as attributes
    # ------------------------------------------------------------------------------------------------
    @staticmethod
    def setting_names() -> list[str]:
        """Every setting, by the name users, `to_dict()` and Tune use."""
        return list(_OWNERS)

    def __getattr__(self, name: str) -> Any:  # only called when normal lookup fails
        part = _OWNERS.get(name)
        if part is None:
            raise AttributeError(f"{type(self).__name__!r} has no setting or attribute {name!r}{_hint(name)}")
        return self.__dict__["_values"][part][name]

    def __setattr__(self, name: str, value: Any) -> None:
        part = _OWNERS.get(name)
        if part is None:
            raise AttributeError(f"{type(self).__name__!r} has no setting {name!r}{_hint(name)}. Fix: use one of "
                                 "FlashReinforceConfig.setting_names()")
        self._values[part][name] = value

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other._values == self._values  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        default = FlashReinforceConfig()
        changed = ", ".join(f"{k}={v!r}" for k, v in self.to_dict().items() if getattr(default, k) != getattr(self, k))
        return f"{type(self).__name__}({changed})"

    # ------------------------------------------------------------------------------------------------
    # builder methods
    # ------------------------------------------------------------------------------------------------
    def _section(self, section: str, arguments: Mapping[str, Any]) -> FlashReinforceConfig:
        """Set the settings a builder method was given; ``arguments`` is its ``locals()``: ``self``, its
        section's settings (``NotProvided`` where not given) and ``misplaced`` (any other keyword)."""
        settings = {name: value for name, value in arguments.items() if name not in ("self", "misplaced")}
        settings.update(arguments.get("misplaced", {}))
        for name in settings:
            if _SECTIONS.get(name) != section:
                where = (f"it is set by .{_SECTIONS[name]}()" if name in _SECTIONS
                         else f"no such setting{_hint(name)}")
                raise TypeError(f"{section}() got an unexpected keyword argument {name!r}: {where}")
        for name, value in settings.items():
            if value is not NotProvided:
                setattr(self, name, _normalized(name, value))
        return self

    def build_algo(self) -> Any:
        """Validate, join (or start) a Ray cluster, check resources, start the actors (a FlashReinforce)."""
        module, _, name = self.algo_class.partition(":")
        return getattr(importlib.import_module(module), name)(config=self.copy())

    # ------------------------------------------------------------------------------------------------
    # the parts, built (and so checked)
    # ------------------------------------------------------------------------------------------------
    def env_runner_spec(self, **overrides: Any) -> EnvRunnerSpec:
        """The env runners' spec of this config (``overrides`` win); raises SpecError on a bad value."""
        return EnvRunnerSpec(**{**self._values["env_runners"], **overrides})

    def build_loss(self) -> FlashReinforceLossSpec:
        """The loss object every learner calls, the baseline resolved by the rollout mode."""
        return FlashReinforceLossSpec(**{**self._values["loss"], "baseline": self.effective_baseline})

    def learner_spec(self, *, train_size: int | None = None, **overrides: Any) -> LearnerSpec:
        """The learners' spec: its settings, the derived ones (the sampling temperature, the seed, the loss,
        the horizon of `schedule_horizon(train_size)`) filled in; pass ``model=`` the resolved local folder.
        ``overrides`` win."""
        derived = {"temperature": self.temperature, "seed": self.seed, "routing_replay": self.routing_replay,
                   "log_level": self.log_level, "loss": self.build_loss()}
        if self.weight_sync_dtype is None and self.dtype == "bfloat16" and self.engines_dtype() == "float32":
            derived["weight_sync_dtype"] = "float32"  # the engines hold float32: send the masters, not bf16 roundings
        if self.num_epochs is not None:
            derived["total_updates"] = self.schedule_horizon(train_size)
        return LearnerSpec(**{**self._values["learners"], **derived, **overrides})

    def engines_dtype(self) -> str | None:
        """The env runners' engine weight dtype where this config fixes it, else None (the checkpoint's, on GPU).

        The torch engine: its ``dtype`` option (float32 by default). vLLM: its ``dtype`` option, else
        float32 when the runners have no GPU (vLLM's CPU build; ``flashrl.engines.vllm_engine``). A
        bfloat16 learner whose engines hold float32 syncs its float32 masters
        (``LearnerSpec.weight_sync_dtype``) unless told otherwise.
        """
        options = self.engine_options or {}
        if self.engine == "torch":
            return str(options.get("dtype", "float32"))
        if self.engine == "vllm":
            dtype = options.get("dtype")
            if dtype is not None:
                return None if dtype == "auto" else str(dtype)
            return "float32" if not self.num_gpus_per_env_runner else None
        return None

    def schedule_horizon(self, train_size: int | None) -> int | None:
        """The run's updates: total_updates, or with num_epochs ceil(N / prompts_per_batch) x num_epochs.

        ``train_size`` is the training env's finite task count (None: an infinite source); N is it cut to
        max_samples. This is Molt 0.2.1's horizon under train.force_on_policy (one step per rollout batch,
        the last partial batch counted), computed from the set the run really has.
        """
        if self.num_epochs is None:
            return self.total_updates
        if train_size is None:
            raise ConfigError(
                f"num_epochs: expected a finite training set (a task file or list, ALFWorld games) to count passes "
                f"over, got env {self.env!r} drawing tasks from an infinite source. Fix: set total_updates "
                "instead of num_epochs, or give the env a dataset"
            )
        size = min(int(train_size), self.max_samples) if self.max_samples is not None else int(train_size)
        return -(-size // self.prompts_per_batch) * int(self.num_epochs)

    def algorithm_settings(self) -> FlashReinforceAlgorithmSpec:
        """The driver's own settings, checked."""
        return FlashReinforceAlgorithmSpec(**self._values["algorithm"])

    @property
    def effective_baseline(self) -> Any:
        """The baseline actually used: the setting (a name, a path or an object); None resolves by rollout mode."""
        if self.baseline is not None:
            return self.baseline
        return "group_mean" if self.rollout_mode == "sync_group" else "batch_mean"

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
        # An actor's custom resources go in its bundle: under Tune the actors run inside these bundles.
        learners = [
            {**_bundle(self.num_cpus_per_learner, self.num_gpus_per_learner), **self.custom_resources_per_learner}
            for _ in range(self.num_learners)
        ]
        runners = [
            {**_bundle(self.num_cpus_per_env_runner, self.num_gpus_per_env_runner),
             **self.custom_resources_per_env_runner}
            for _ in range(self.num_env_runners)
        ]
        return [main, *learners, *runners]

    # ------------------------------------------------------------------------------------------------
    # validation
    # ------------------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise `ConfigError` on an impossible setting (every problem at once); warn on a risky one."""
        problems: list[str] = []
        # Each part checks its own settings; the learners' part without the loss, whose own problems the
        # loss reports (so a bad delta does not hide a bad lr).
        learners = {**self._values["learners"], "temperature": self.temperature, "seed": self.seed,
                    "routing_replay": self.routing_replay}
        if self.num_epochs is not None and learners["total_updates"] is None:
            learners["total_updates"] = 1  # a stand-in: the horizon comes from the real set size at setup
        built = {}
        for build in (self.env_runner_spec, lambda: LearnerSpec(**learners), self.build_loss, self.algorithm_settings):
            try:
                built[build] = build()
            except SpecError as err:
                problems += err.problems
        if self.build_loss in built:
            from flashrl.algorithms.flash_reinforce.component_check import component_call_problems

            problems += component_call_problems(built[self.build_loss])  # each component called once
        problem = _env_problem(self.env)
        if problem:
            problems.append(problem)
        elif self.env_runner_spec in built:
            problems += _env_config_problems(built[self.env_runner_spec])
        problems += self._batch_problems()
        route = route_problem(self.engine, self.engine_options, learner_gpus=self.num_gpus_per_learner,
                              runner_gpus=self.num_gpus_per_env_runner, num_env_runners=self.num_env_runners)  # fmt: skip
        problems += [route] if route else []
        if problems:
            bullet = "\n  - "
            unique = list(dict.fromkeys(problems))  # a loss problem shows once, though two parts build the loss
            raise ConfigError(f"Invalid FlashReinforceConfig:{bullet}{bullet.join(unique)}")
        self._warn_risky()

    def _batch_problems(self) -> list[str]:
        return list(self._batch_problem_lines())

    def _batch_problem_lines(self):
        """The batch size against the baseline, the rollout mode, the group size and the learners."""
        b = self.train_batch_size
        if not is_int(b) or b < 1:
            return  # EnvRunnerSpec says so
        baseline = self.effective_baseline
        if baseline in ("batch_mean", "leave_one_out") and b < 2:
            yield (f"train_batch_size: expected >= 2 with baseline {baseline!r} (B = 1 makes every advantage "
                   f"0), got {b}. Fix: raise train_batch_size or use baseline='none'")
        if self.rollout_mode == "sync_group":
            g = self.group_size
            if not is_int(g) or g < 1:
                return  # FlashReinforceAlgorithmSpec says so
            if b % g:
                yield (f"train_batch_size: expected a multiple of group_size={g} in 'sync_group' mode, got {b}. "
                       f"Fix: use train_batch_size={max(g, b - b % g)}")
            elif baseline in GROUP_BASELINES and g < 2:
                yield (f"group_size: expected >= 2 with the {baseline!r} baseline, got {g}. Fix: raise "
                       f"group_size or pick baseline='batch_mean'")
        elif baseline in GROUP_BASELINES:
            yield ("baseline: expected a per-batch baseline in 'async' mode (one rollout per prompt has no "
                   f"groups), got {baseline!r}. Fix: use baseline='batch_mean' or rollout_mode='sync_group'")
        if self.num_epochs is not None and self.total_updates is not None:
            yield (f"total_updates: expected None with num_epochs={self.num_epochs!r} (the horizon then follows the "
                   f"training set's size), got {self.total_updates!r}. Fix: set one of total_updates and num_epochs")
        if self.optimizer_offload is True and not (is_int(self.num_learners) and self.num_learners >= 2):
            yield (f"optimizer_offload: expected False, or True with num_learners >= 2 (sharded learners), got True "
                   f"with num_learners={self.num_learners!r}. Fix: set optimizer_offload=False, or num_learners >= 2")
        if is_int(self.num_learners) and self.num_learners > 1 and b < self.num_learners:
            yield (f"train_batch_size: expected >= num_learners ({self.num_learners}) so every learner gets "
                   f"data, got {b}. Fix: raise train_batch_size or lower num_learners")
        if self.engine == "vllm" and is_int(self.lora_rank) and self.lora_rank not in VLLM_LORA_RANKS:
            yield (f"lora_rank: expected one of {VLLM_LORA_RANKS} with engine='vllm' (its max_lora_rank choices), "
                   f"got {self.lora_rank}. Fix: use the nearest of those, e.g. lora_rank=16")

    def _warn_risky(self) -> None:
        if self.top_p < 1.0 or self.top_k > 0:
            warnings.warn(
                f"top_p={self.top_p}, top_k={self.top_k}: truncated sampling can put tokens the learner's "
                "policy prefers outside the behavior support, which breaks the importance correction. "
                "Prefer top_p=1.0, top_k=0 (temperature is fine).",
                stacklevel=3,
            )
        if is_number(self.delta) and self.delta == 0 and self.trust_region != "none":
            warnings.warn(
                "delta=0 accepts only trajectories whose drift is exactly 0: with a real inference engine (never "
                "bit-identical to the learner) the trust region rejects every trajectory and nothing trains. "
                "Use e.g. delta=1e-3 (the reference's gate), or math.inf for no trust region.",
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

    def validate_custom_resources(self, nodes: list[Mapping[str, float]]) -> None:
        """Raise `ConfigError` if no alive node could ever grant an actor's custom resources.

        Args:
            nodes: the resources of each alive node (``ray.nodes()``'s totals), as
                `flashrl.ray_utils.custom_resource_problems` reads them.
        """
        from flashrl.ray_utils import custom_resource_problems

        problems = custom_resource_problems(
            {"custom_resources_per_learner": (self.num_learners, self.custom_resources_per_learner),
             "custom_resources_per_env_runner": (self.num_env_runners, self.custom_resources_per_env_runner)},
            nodes,
        )
        if problems:
            raise ConfigError("Custom resource requests the Ray cluster cannot grant:\n  - " + "\n  - ".join(problems))

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
        """A dict of every setting by its flat name (tuples become lists), as RLlib's ``to_dict``.

        User code given as an object (a loss component, a reward function in ``env_config``, the
        callbacks class, an env class) stays the object, so Ray Tune's ``param_space=config`` carries it to
        the trials (Tune pickles it with cloudpickle; an env class's module by value); ``from_dict`` of this
        dict round-trips. An env id registered by user code, or an env class's path, becomes an `EnvRef`
        (a ``str`` equal to it that carries the Gymnasium EnvSpec, so a trial makes the env without the
        user's script). For text (a checkpoint's ``config.json``, ``--print-config``, trackers) use `serialize`.
        """
        out = {name: _plain(value, text=False) for values in self._values.values() for name, value in values.items()}
        out["env"] = _env_for_trials(out["env"])
        return out

    def serialize(self) -> dict[str, Any]:
        """`to_dict` as JSON-able data (RLlib's ``serialize``): user code objects written
        ``"<object module:qualname>"``; a component configured by its ``"module:name"`` path stays the path.

        ``from_dict`` of such a dict fails at ``validate()`` until the object is given again
        (``FlashReinforce.from_checkpoint(path, baseline=MyBaseline())``); a path round-trips as text, and
        ``from_checkpoint`` imports it only when given again or trusted (``flashrl.checkpoints.stored_code``).
        """
        return {name: _plain(value, text=True) for values in self._values.values() for name, value in values.items()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FlashReinforceConfig:
        """Inverse of `to_dict()`; unknown keys are an error that names the closest setting."""
        unknown = [k for k in data if k not in _OWNERS]
        if unknown:
            hints = [f"{key!r}{_hint(key)}" for key in unknown]
            raise ConfigError(
                f"Unknown FlashReinforceConfig keys: {', '.join(hints)}. Expected keys among the settings of "
                "FlashReinforceConfig (see FlashReinforceConfig().to_dict()). Fix: rename or remove them."
            )
        return cls(**data)

    def copy(self) -> FlashReinforceConfig:
        """A deep copy (user code objects are shared, not copied)."""
        new = type(self)()
        object.__setattr__(new, "_values", _copied(self._values))
        return new

    def update_from_dict(self, data: Mapping[str, Any]) -> FlashReinforceConfig:
        """Set the given settings (same checks as `from_dict`; the other settings keep their values)."""
        type(self).from_dict(data)  # unknown keys are an error
        for name, value in data.items():
            setattr(self, name, _normalized(name, value))
        return self


def refuse_checkpoint_code(path: str, stored: Mapping[str, Any], *, given: Mapping[str, Any], fix: str) -> None:
    """`UntrustedCodeError` naming every setting of a checkpoint's ``stored`` config that names code
    (``flashrl.checkpoints.stored_code``), except the settings the user gives again (``given``).

    The env the run will make (``given``'s, else the stored one) says which ``env_config`` keys are code;
    an env the user gives as a path is the user's code, imported to ask it.
    """
    import gymnasium

    import flashrl.envs  # noqa: F401 - registers the flashrl/* ids, whose classes declare their code arguments
    from flashrl.checkpoints.stored_code import refuse_stored_code

    if not isinstance(stored, Mapping):
        return  # not a config at all: from_dict says so
    env = given.get("env", stored.get("env"))
    if "env" in given and is_path(env) and env not in gymnasium.registry:
        try:
            env = env_class(env)
        except UserEnvError:
            pass  # validate() says what is wrong with it
    rest = {name: value for name, value in stored.items() if name not in given}
    refuse_stored_code(path, rest, [cls for cls, _ in _PARTS.values()], env=env, fix=fix)


def _hint(name: str) -> str:
    close = difflib.get_close_matches(name, list(_OWNERS), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _bundle(cpus: float, gpus: float) -> dict[str, float]:
    bundle = {"CPU": float(cpus)}
    if gpus:
        bundle["GPU"] = float(gpus)
    return bundle


def _env_config_problems(spec: EnvRunnerSpec) -> list[str]:
    """Keys of the env configs (training, evaluation overrides, each split's) the env's constructor does not
    take, and user code among them (or the entry point) that cannot reach the runners."""
    problems = env_config_problems(spec.env, spec.env_config)
    problems += env_config_problems(spec.env, spec.evaluation_env_config, name="evaluation_env_config")
    for split, overrides in spec.evaluation_splits.items():
        problems += env_config_problems(spec.env, overrides, name=f"evaluation_splits[{split!r}]")
    return problems + env_code_problems(spec)


def _env_problem(env: Any) -> str | None:
    """An env id that is not registered, or the text a saved config keeps for an env class; None when the
    setting is fine or its form is wrong (a bad class or path, None: `EnvRunnerSpec`'s checks say so)."""
    import gymnasium

    import flashrl.envs  # noqa: F401 - registers the flashrl/* ids
    if not isinstance(env, str) or not env or isinstance(env, EnvRef) or env in gymnasium.registry:
        return None
    if is_description(env):
        return (f"env: expected {FORMS}, got {env!r}, the text a saved config keeps for an env class. Fix: pass "
                "the class again (e.g. FlashReinforce.from_checkpoint(path, env=MyEnv)), or configure the env by "
                "its 'module:Class' path")
    if is_path(env):
        return None  # a class's path
    known = sorted(k for k in gymnasium.registry if k.startswith("flashrl/"))
    close = difflib.get_close_matches(env, list(gymnasium.registry), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return (f"env: expected a registered Gymnasium id such as {known or ['flashrl/Math-v0']}, got "
            f"{env!r}{hint}. Fix: register it with gymnasium.register(...) before building, fix the name, or "
            "pass the env class itself (.environment(MyEnv))")


def _env_for_trials(env: Any) -> Any:
    """``to_dict()``'s form of the env setting: one that a process without the user's script can make.

    An id registered here whose entry point is not flashrl's, or a class's path: an `EnvRef` carrying the
    EnvSpec the runners get (a user-code entry point imported, `runner_env_spec`). A class: itself, its
    module pickled by value from now on (`ship_by_value`). Anything else (flashrl's own ids, a value
    `validate()` refuses): as it is.
    """
    import gymnasium

    if isinstance(env, type):
        ship_by_value(env)
        return env
    if isinstance(env, EnvRef) or not isinstance(env, str) or not env or is_description(env):
        return env
    try:
        if env in gymnasium.registry:
            spec = runner_env_spec(env)
            return env if is_flashrl_entry_point(spec.entry_point) else EnvRef(env, spec)
        if is_path(env):
            return EnvRef(env, class_spec(env_class(env)))
    except (UserCodeError, UserEnvError):
        pass  # validate() says what is wrong
    return env
