"""`kill_and_confirm`, the fault drills' kill: once it returns, the actor is dead to every caller.

`ray.kill` only asks, and a call made right after it could still be answered: CI once saw a killed
runner answer the group's next ping (`tests/weight_sync/test_runners.py`), so the drill found nothing to restart.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from flashrl.ray_utils import kill_and_confirm

pytestmark = pytest.mark.ray


@pytest.mark.parametrize("kind", ["async", "busy_threaded"])
def test_a_call_right_after_the_kill_fails(ray_session, kind) -> None:
    ray = ray_session

    @ray.remote(num_cpus=0)
    class Async:
        async def ping(self) -> int:
            return 1

        async def work(self) -> None:
            await asyncio.sleep(60)

    @ray.remote(num_cpus=0)
    class Threaded:
        def ping(self) -> int:
            return 1

        def work(self) -> None:
            time.sleep(60)

    actor = (Async if kind == "async" else Threaded).remote()
    assert ray.get(actor.ping.remote(), timeout=60) == 1
    busy = actor.work.remote()  # the threaded actor queues every probe behind this call
    start = time.monotonic()
    kill_and_confirm(actor, timeout_s=30)
    assert time.monotonic() - start < 30
    for ref in (actor.ping.remote(), busy):
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(ref, timeout=10)


def test_a_kill_that_is_never_delivered_times_out_naming_the_cause(ray_session, monkeypatch) -> None:
    """The cluster drops the kill (here: `ray.kill` does nothing): the helper gives up and says why."""
    ray = ray_session

    @ray.remote(num_cpus=0)
    class Alive:
        def ping(self) -> int:
            return 1

    actor = Alive.remote()
    assert ray.get(actor.ping.remote(), timeout=60) == 1
    real_kill = ray.kill
    monkeypatch.setattr(ray, "kill", lambda *args, **kwargs: None)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"still answered calls after 2 s.*not delivering the kill"):
        kill_and_confirm(actor, timeout_s=2)
    assert 2 <= time.monotonic() - start < 10
    assert ray.get(actor.ping.remote(), timeout=60) == 1  # it was never killed
    real_kill(actor, no_restart=True)
