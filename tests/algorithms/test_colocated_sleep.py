"""The driver's side of a colocated run: the engine options it starts the runners with, and the order
of sleep, update, push and wake in one iteration (fakes for the learner group, the runners and the route)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from flashrl.algorithms import FlashReinforceConfig
from flashrl.algorithms.flash_reinforce.algorithm import FlashReinforce
from flashrl.algorithms.flash_reinforce.config import ConfigError
from flashrl.plan import plan_run


def _config(learner_gpus: float = 0.5, runner_gpus: float = 0.5, **env_runners: Any) -> FlashReinforceConfig:
    return (
        FlashReinforceConfig()
        .environment("flashrl/Math-v0")
        .training(model="Qwen/Qwen2.5-Math-1.5B", dtype="bfloat16", train_batch_size=8)
        .learners(num_learners=1, num_gpus_per_learner=learner_gpus, max_tokens_per_micro_batch=1024)
        .env_runners(
            num_env_runners=1, num_gpus_per_env_runner=runner_gpus, max_episode_tokens=1024, max_new_tokens=512,
            **env_runners,
        )
    )


def test_colocated_runners_start_with_sleep_mode_and_the_learners_bytes() -> None:
    # Qwen2.5-Math-1.5B, bfloat16, AdamW, one learner: peak 36,919,719,936 bytes (34.38 GiB), the
    # number tests/recipes/test_colocated_plan.py plans with
    assert plan_run(_config()).engine_options == {
        "weight_sync": "ipc", "sleep_mode": True, "colocated_gpu_fraction": 0.5,
        "colocated_learner_bytes": 36919719936, "log_level": "WARNING",
    }  # fmt: skip  # the peak with sleep mode too: the engine wakes next to what the learner still holds
    off = plan_run(_config(engine_sleep_mode=False)).engine_options
    assert off == {"weight_sync": "ipc", "colocated_gpu_fraction": 0.5, "colocated_learner_bytes": 36919719936,
                   "log_level": "WARNING"}  # framework_log_level reaches every vLLM engine
    assert plan_run(_config(1, 1)).engine_options == {"weight_sync": "nccl", "log_level": "WARNING"}
    assert plan_run(_config(0, 0)).engine_options == {"weight_sync": "shm", "log_level": "WARNING"}


def test_sleep_mode_on_cpu_engines_is_refused_by_the_config() -> None:
    with pytest.raises(ConfigError, match="CPU build has no sleep mode"):
        _config(0, 0, engine_sleep_mode=True).validate()
    with pytest.raises(ConfigError, match="engine_sleep_mode: expected"):
        _config(engine_sleep_mode="yes").validate()


class _Recorder:
    def __init__(self, calls: list[str], version: int = 0, *, updates: bool = True) -> None:
        self.calls, self.version, self.updates = calls, version, updates

    # the learner group
    def update(self, batch: Any) -> dict[str, float]:
        self.calls.append("learner update")
        self.version += int(self.updates)
        return {"loss": 0.0}

    def release_memory(self) -> None:
        self.calls.append("learner frees its cache")

    # the env runner group
    def sleep_engines(self) -> None:
        self.calls.append("sleep engines")

    def wake_engines(self) -> None:
        self.calls.append("wake engines")

    # the weight-sync route
    def push(self, learners: Any, runners: Any) -> float:
        self.calls.append("push weights")
        return 0.0


def _algorithm(calls: list[str], *, sleep: bool, updates: bool = True) -> FlashReinforce:
    algo = FlashReinforce.__new__(FlashReinforce)  # no Ray, no actors: only what one update touches
    fake = _Recorder(calls, updates=updates)
    algo.learner_group, algo._weight_sync, algo._engines_sleep, algo.pad_token_id = fake, fake, sleep, 0
    algo.stream = SimpleNamespace(group=fake)
    return algo


@pytest.fixture(autouse=True)
def _no_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    import flashrl.learners

    monkeypatch.setattr(flashrl.learners.TrainBatch, "from_episodes", staticmethod(lambda *a, **k: "batch"))


COLLECTED = SimpleNamespace(episodes=[], group_ids=None)


def test_colocated_engines_sleep_through_the_update_and_wake() -> None:
    calls: list[str] = []
    _algorithm(calls, sleep=True)._update_and_push(COLLECTED, 0)
    # the push wakes each engine (weights, load, empty prefix cache, KV cache); the last wake finds them awake
    assert calls == ["sleep engines", "learner update", "learner frees its cache", "push weights", "wake engines"]
    calls.clear()
    _algorithm(calls, sleep=True, updates=False)._update_and_push(COLLECTED, 0)  # a skipped batch: no push
    assert calls == ["sleep engines", "learner update", "learner frees its cache", "wake engines"]
    calls.clear()
    _algorithm(calls, sleep=False)._update_and_push(COLLECTED, 0)
    assert calls == ["learner update", "push weights"]


def test_a_failed_update_still_wakes_the_engines() -> None:
    calls: list[str] = []
    algo = _algorithm(calls, sleep=True)

    def fail(batch: Any) -> None:
        calls.append("learner update")
        raise RuntimeError("learner died")

    algo.learner_group.update = fail
    with pytest.raises(RuntimeError, match="learner died"):
        algo._update_and_push(COLLECTED, 0)
    assert calls == ["sleep engines", "learner update", "wake engines"]


# ------------------------------------------------------------------------------------ the wake's memory
class _SharedGpu:
    """One 80 GiB GPU shared by a learner and a sleeping engine, as the plan sizes them: a ledger of
    what each side holds after every step of an iteration, and a check that the two fit.

    The learner's caching allocator keeps what it reserved (its update's peak) until it frees its
    cache; vLLM's wake maps fresh physical memory for the weights and then for the whole KV cache
    (its ``gpu_memory_utilization`` share), next to whatever the learner still reserves.
    """

    def __init__(self, config: FlashReinforceConfig) -> None:
        from flashrl.engines.colocation import colocated_memory_utilization

        plan = plan_run(config)
        self.device = 80 * 2**30
        self.learner = plan.learner_memory
        self.share = colocated_memory_utilization(
            self.device, learner_bytes=plan.engine_options["colocated_learner_bytes"], runner_gpus=0.5
        ) * self.device  # fmt: skip
        self.kept = self.learner.weights + self.learner.master + self.learner.optimizer  # between updates
        self.learner_reserved, self.engine = self.kept, self.share  # the engine awake, sampling
        self.steps: list[tuple[str, int]] = []

    def record(self, step: str) -> None:
        used = self.learner_reserved + self.engine
        self.steps.append((step, used))
        assert used <= self.device, f"{step}: {used / 2**30:.2f} GiB of the {self.device / 2**30:.0f} GiB device"

    # the env runner group
    def sleep_engines(self) -> None:
        self.engine = 0  # level 1: the weights in host memory, the KV cache freed
        self.record("sleep engines")

    def wake_engines(self) -> None:
        self.engine = self.share
        self.record("wake engines")

    # the learner group
    def update(self, batch: Any) -> dict[str, float]:
        self.learner_reserved = self.learner.total  # the update's peak, cached when it ends
        self.version += 1
        self.record("learner update")
        return {"loss": 0.0}

    def release_memory(self) -> None:
        self.learner_reserved = self.kept  # gradients set to None, activations gone, cache emptied
        self.record("learner frees its cache")

    # the weight-sync route: the engine's weights wake, the learner's push buffers, then the KV cache
    def push(self, learners: Any, runners: Any) -> float:
        self.learner_reserved = max(self.learner_reserved, self.kept + self.learner.push)
        self.engine = self.share  # the weights, then the KV cache: the whole reservation again
        self.record("push weights (the engine wakes)")
        self.learner_reserved = max(self.learner_reserved - self.learner.push, self.kept)
        return 0.0


def test_the_colocated_engine_wakes_within_the_device() -> None:
    """The 1.5B model on one 80 GiB GPU (0.5 + 0.5, sleep mode on by default): at every step of an
    iteration the learner's reserved bytes plus the engine's fit the device. The engine's share is
    what the learner's peak leaves (34.38 GiB: 0.52, 41.6 GiB); with the share its static state used to
    leave (28.75 GiB: 0.59, 47.2 GiB) the wake after the push would not fit: 34.38 + 47.2 > 80."""
    gpu = _SharedGpu(_config())
    algo = FlashReinforce.__new__(FlashReinforce)
    gpu.version = 0
    algo.learner_group, algo._weight_sync, algo._engines_sleep, algo.pad_token_id = gpu, gpu, True, 0
    algo.stream = SimpleNamespace(group=gpu)
    algo._update_and_push(COLLECTED, 0)
    assert [step for step, _ in gpu.steps] == [
        "sleep engines", "learner update", "learner frees its cache", "push weights (the engine wakes)",
        "wake engines",
    ]  # fmt: skip
    assert round(gpu.share / 2**30, 2) == 41.6
    wake = dict(gpu.steps)["push weights (the engine wakes)"]
    assert wake == gpu.kept + gpu.learner.push + gpu.share  # what the learner keeps, its push buffers, the engine


def test_a_learner_on_cuda_empties_its_cache_and_one_on_cpu_has_nothing_to_free(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    from flashrl.learners.learner import Learner

    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 3 * 2**30)
    assert Learner.release_memory(SimpleNamespace(device=torch.device("cuda", 0))) == 3 * 2**30
    assert calls == ["empty_cache"]
    assert Learner.release_memory(SimpleNamespace(device=torch.device("cpu"))) == 0 and calls == ["empty_cache"]
