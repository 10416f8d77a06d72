"""The books balance and nothing hangs: few prompts, checkpoints with pending episodes, restarts."""

from __future__ import annotations

import threading

import pytest
import ray

from flashrl.algorithms import FlashReinforce
from flashrl.env_runners import EnvRunnerGroup, EnvRunnerGroupError

pytestmark = pytest.mark.ray


def unbalanced(r: dict) -> float:
    """started - (trained + pending + skipped + lost + in flight): 0 when the books balance."""
    skipped = sum(v for k, v in r.items() if k.startswith("env_runners/num_skipped_"))
    return r["env_runners/num_started_lifetime"] - (
        r["env_runners/num_episodes_lifetime"]
        + r["env_runners/num_pending_episodes"]
        + skipped
        + r["env_runners/num_lost_episodes_lifetime"]
        + r["env_runners/num_in_flight"]
    )


def _train_in_thread(algo, timeout_s: float):
    """algo.train() in a thread: returns (result, error), or fails the test if it hangs."""
    out: dict = {}

    def run():
        try:
            out["result"] = algo.train()
        except Exception as err:  # noqa: BLE001 - handed back to the test
            out["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"train() still running after {timeout_s} s: the collection loop hangs"
    return out.get("result"), out.get("error")


@pytest.mark.timeout(300)
def test_fewer_distinct_prompts_than_the_batch_fails_clearly_and_the_queue_stays_bounded(ray_session, tiny_config):
    config = tiny_config(
        env="flashrl-test/Parity-v0", env_config={"num_tasks": 2}, sample_timeout_s=15.0, tensorboard=False
    )
    algo = config.build_algo()
    try:
        _, error = _train_in_thread(algo, timeout_s=120)
        assert isinstance(error, EnvRunnerGroupError)
        assert "fewer distinct prompts than train_batch_size" in str(error)
        assert "2 prompts already in the batch" in str(error)
        # The waiting queue is bounded; what it could not hold was dropped and counted.
        assert len(algo.stream.pending) <= algo.stream.pending_capacity + config.train_batch_size
        assert algo.stream.totals["skipped/pending_overflow"] > 0
    finally:
        algo.stop()


@pytest.mark.timeout(600)
def test_pending_episodes_are_booked_across_a_checkpoint(ray_session, tiny_config, tmp_path):
    # Five tasks for batches of four: a repeated prompt (it waits for the next batch) comes within a
    # few batches whatever the timing (no repeat in 10 batches has probability ~1e-7), and two runners
    # answering with up to B episodes each overflow a batch as well.
    config = tiny_config(
        env="flashrl-test/Parity-v0", env_config={"num_tasks": 5}, num_env_runners=2, tensorboard=False,
        console_every=0,
    )
    algo = config.build_algo()
    try:
        for _ in range(10):
            r = algo.train()
            if algo.stream.pending:
                break
        pending = len(algo.stream.pending)
        assert pending > 0
        assert unbalanced(r) == 0
        path = algo.save_to_path(str(tmp_path / "ckpt"))
        # Restored into the running algorithm: the books are the checkpoint's and still balance.
        algo.restore_from_path(path)
        assert algo.stream.pending == type(algo.stream.pending)()
        r = algo.train()
        assert unbalanced(r) == 0
    finally:
        algo.stop()
    resumed = FlashReinforce.from_checkpoint(path)
    try:
        r = resumed.train()
        assert unbalanced(r) == 0
        assert r["env_runners/num_lost_episodes_lifetime"] >= pending
    finally:
        resumed.stop()


@ray.remote
def _slow(value, delay_s: float):
    """`value` after `delay_s`: a weights reference that takes a while to resolve (a large model's)."""
    import time

    time.sleep(delay_s)
    return value


@pytest.mark.timeout(300)
def test_a_restarted_runner_samples_with_the_current_weights(ray_session, tiny_config, replacement_versions):
    from transformers import AutoModelForCausalLM

    config = tiny_config(env="flashrl-test/Parity-v0", num_env_runners=1)
    weights = AutoModelForCausalLM.from_pretrained(config.model).state_dict()
    group = EnvRunnerGroup(config.env_runner_spec(), model_path=config.model)
    try:
        group.setup()
        group.start_streaming()
        assert group.next_reports(30.0)
        # New weights whose reference resolves only after 5 s, then the runner dies: its replacement
        # must not sample a single episode with its initial weights meanwhile.
        group.broadcast_weights(5, _slow.remote(weights, 5.0))
        group.kill(0)
        versions = replacement_versions(group)
        assert group.num_restarts == 1
        assert len(versions) >= 8 and set(versions) == {5}
    finally:
        group.stop()
