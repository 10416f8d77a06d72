"""A runner's side of a pushed transfer: the lease on its pause, an abort, the plan check.

The EnvRunner is real (in this process, its torch engine started); the engine's push API is vLLM's
on a GPU, so after setup it is replaced by `PushEngine`, which records the calls the runner makes and
holds the runner's state the way `VLLMEngine` does (paused between begin and end, broken after an abort).
"""

from __future__ import annotations

import asyncio

import pytest

from flashrl.env_runners.env_runner import EnvRunner
from flashrl.weight_sync.vllm_push import (
    AbortTransfer,
    BeginTransfer,
    CheckPlan,
    EndTransfer,
    ReleaseTransfer,
)


class PushEngine:
    """`VLLMEngine`'s push-route surface, simulated: begin / end / abort / shutdown and the plan check;
    everything else (tokenizer, context, generation) is the started torch engine's."""

    weight_sync = "nccl"

    def __init__(self, engine) -> None:
        self._inner = engine
        self.version = 0
        self.calls: list = []
        self.paused = False
        self.broken: str | None = None

    async def begin_weight_transfer(self) -> None:
        self.calls.append("begin")
        self.paused = True

    async def end_weight_transfer(self, version: int) -> None:
        self.calls.append(("end", version))
        self.version, self.paused = version, False

    async def abort_weight_transfer(self, reason: str) -> None:
        self.calls.append(("abort", reason))
        self.broken, self.paused = reason, False

    async def shutdown_weight_transfer(self) -> None:
        self.calls.append("shutdown")

    def check_weight_plan(self, plan) -> int:
        if any(name == "unknown.weight" for name, _, _ in plan):
            raise ValueError("unknown ['unknown.weight']")
        return len(plan)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


@pytest.fixture
def runner(tiny_config, tiny_llama_path):
    runner = EnvRunner(tiny_config().env_runner_spec(), runner_index=0, num_runners=1, model_path=tiny_llama_path)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(runner.setup())
    runner._engine = PushEngine(runner._engine)
    yield runner, loop
    loop.run_until_complete(runner.stop())
    loop.close()


def test_a_transfer_ended_in_time_keeps_the_runner(runner) -> None:
    runner, loop = runner

    async def transfer() -> int:
        await runner.weight_sync(BeginTransfer(lease_s=0.5))
        assert runner.weight_inbox.lock.locked()
        version = await runner.weight_sync(EndTransfer(3))
        await asyncio.sleep(0.7)  # past the lease: it was cancelled
        return version

    assert loop.run_until_complete(transfer()) == 3
    assert runner._engine.calls == ["begin", ("end", 3)] and not runner.weight_inbox.lock.locked()
    assert runner._fatal is None


def test_a_learner_that_never_ends_the_transfer_loses_the_lease(runner) -> None:
    runner, loop = runner

    async def abandoned() -> None:
        await runner.weight_sync(BeginTransfer(lease_s=0.2))
        await asyncio.sleep(0.6)  # the learner died between begin and end

    loop.run_until_complete(abandoned())
    engine = runner._engine
    assert engine.calls[0] == "begin" and engine.calls[1][0] == "abort"
    assert "within its 0.2 s lease" in engine.calls[1][1] and not engine.paused
    assert not runner.weight_inbox.lock.locked()  # a streamed update could load again
    with pytest.raises(RuntimeError, match="a pushed weight transfer was aborted"):
        loop.run_until_complete(runner.poll(1, 0.1))  # the group restarts this runner
    with pytest.raises(RuntimeError, match="no transfer is open"):
        loop.run_until_complete(runner.weight_sync(EndTransfer(4)))  # a late end is refused


def test_an_abort_from_the_learner_and_a_normal_release(runner) -> None:
    runner, loop = runner
    loop.run_until_complete(runner.weight_sync(ReleaseTransfer()))
    assert runner._engine.calls == ["shutdown"]
    loop.run_until_complete(runner.weight_sync(BeginTransfer()))  # no lease
    loop.run_until_complete(runner.weight_sync(AbortTransfer("a broadcast hung")))
    assert runner._engine.calls[-1] == ("abort", "a broadcast hung") and not runner.weight_inbox.lock.locked()
    assert isinstance(runner._fatal, RuntimeError)


def test_the_plan_check_reaches_the_engine(runner) -> None:
    runner, loop = runner
    assert loop.run_until_complete(runner.weight_sync(CheckPlan([("model.norm.weight", "float32", [128])]))) == 1
    with pytest.raises(ValueError, match="unknown"):
        loop.run_until_complete(runner.weight_sync(CheckPlan([("unknown.weight", "float32", [1])])))
