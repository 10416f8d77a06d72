"""A runner's side of sleep mode: the engine sleeps and wakes under the runner's weights lock.

The EnvRunner is real (in this process, its torch engine started); sleep mode is vLLM's on a GPU
(its CPU build has none), so after setup the engine is wrapped in `SleepEngine`, which records the
calls the runner makes and otherwise is the torch engine.
"""

from __future__ import annotations

import asyncio

import pytest

from flashrl.env_runners.env_runner import EnvRunner
from flashrl.weight_sync.messages import LoadWeights
from flashrl.weight_sync.vllm_push import BeginTransfer, EndTransfer


class SleepEngine:
    """`VLLMEngine`'s sleep-mode surface, simulated: sleep / wake_up, and an update that takes a while;
    the torch engine's tokenizer and context stay on ``inner``."""

    def __init__(self, inner) -> None:
        self.inner, self.version, self.calls = inner, 0, []
        self.max_model_len, self.tokenizer = inner.max_model_len, inner.tokenizer  # what setup() reads

    async def sleep(self) -> None:
        self.calls.append("sleep")

    async def wake_up(self) -> None:
        self.calls.append("wake_up")

    async def update_weights(self, weights, version: int) -> None:
        self.calls.append(("update start", version))
        await asyncio.sleep(0.05)  # the runner's loop runs other calls meanwhile
        self.version = version
        self.calls.append(("update end", version))


@pytest.fixture
def runner(tiny_config, tiny_llama_path):
    """A started runner (its torch engine, then wrapped) and the loop it runs on."""
    loop = asyncio.new_event_loop()
    started = EnvRunner(tiny_config().env_runner_spec(), runner_index=0, num_runners=1, model_path=tiny_llama_path)
    loop.run_until_complete(started.setup())
    started._engine = SleepEngine(started._engine)
    try:
        yield started, loop
    finally:
        started._engine = started._engine.inner  # stop() closes the real engine
        loop.run_until_complete(started.stop())
        loop.close()


def test_a_wake_queued_behind_a_weight_update_waits_for_it(runner) -> None:
    runner, loop = runner

    async def iteration() -> None:
        await runner.sleep_engine()
        # the shm route's broadcast does not wait; the driver's wake comes right after it
        await asyncio.gather(runner.weight_sync(LoadWeights(1, {})), runner.wake_engine())

    loop.run_until_complete(iteration())
    assert runner._engine.calls == ["sleep", ("update start", 1), ("update end", 1), "wake_up"]
    assert not runner.weight_inbox.lock.locked()


def test_sleep_waits_for_an_open_pushed_transfer(runner) -> None:
    runner, loop = runner
    runner._engine.begin_weight_transfer = lambda: runner._engine.calls.append("begin") or asyncio.sleep(0)
    runner._engine.end_weight_transfer = lambda version: runner._engine.calls.append("end") or asyncio.sleep(0)

    async def overlap() -> None:
        await runner.weight_sync(BeginTransfer())
        sleeping = asyncio.ensure_future(runner.sleep_engine())
        await asyncio.sleep(0.05)
        assert not sleeping.done()  # the transfer holds the weights lock
        await runner.weight_sync(EndTransfer(2))
        await sleeping

    loop.run_until_complete(overlap())
    assert runner._engine.calls == ["begin", "end", "sleep"]
