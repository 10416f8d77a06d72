"""The transports' registry and the one door on each side: a new transport is one file plus one line.

`echo_transport.py` below is such a file (its own messages, halves and route); registering it is one
entry of `TRANSPORTS`, and the runner's inbox, the learner's outbox and the driver's `route_for`
take it with no other change. Messages nobody declared are refused with the fix.
"""

from __future__ import annotations

import asyncio

import pytest

from flashrl.weight_sync import registry
from flashrl.weight_sync.endpoints import WeightInbox, WeightOutbox
from flashrl.weight_sync.messages import LoadWeights, PutBuckets
from flashrl.weight_sync.registry import TRANSPORTS, Registration, transport, transports
from flashrl.weight_sync.route import route_for
from flashrl.weight_sync.vllm_push import EndTransfer, Push

ECHO_TRANSPORT = '''
from dataclasses import dataclass

from flashrl.weight_sync.receiver import RunnerMessage, WeightReceiver
from flashrl.weight_sync.sender import LearnerMessage, WeightSender
from flashrl.weight_sync.transport import Transport, WeightSyncRoute


@dataclass(frozen=True)
class Ping(RunnerMessage):
    text: str


@dataclass(frozen=True)
class Send(LearnerMessage):
    pass


class EchoReceiver(WeightReceiver):
    messages = (Ping,)

    async def handle(self, message):
        return message.text * 2


class EchoSender(WeightSender):
    messages = (Send,)

    def handle(self, message):
        return ("sent by rank", self.rank)


class EchoRoute(WeightSyncRoute):
    name = "echo"

    def push(self, learners, runners):
        return 1.5


class EchoTransport(Transport):
    name = "echo"
    sender = EchoSender
    receiver = EchoReceiver

    def route(self, facts, *, wait_for_load, bucket_bytes):
        return EchoRoute(bucket_bytes=bucket_bytes)
'''


@pytest.fixture
def fresh_registry():
    transport.cache_clear()
    yield
    transport.cache_clear()


def _inbox() -> WeightInbox:
    async def ready() -> None:
        return None

    return WeightInbox(lambda: None, ready=ready, on_abort=lambda reason: None)


def test_the_registered_transports_are_shm_nccl_ipc_and_lora_each_named_as_registered(fresh_registry) -> None:
    assert list(TRANSPORTS) == ["shm", "nccl", "ipc", "lora"]
    assert [t.name for t in transports()] == ["shm", "nccl", "ipc", "lora"]
    assert transport("nccl") is transport("nccl")  # one instance per name
    assert type(transport("nccl")).sender is type(transport("ipc")).sender  # vLLM's two backends share halves
    with pytest.raises(ValueError, match=r"expected a transport in \('shm', 'nccl', 'ipc', 'lora'\), got 'rdma'. Fix:"):
        transport("rdma")


def test_no_two_halves_declare_one_message_type(fresh_registry) -> None:
    for side in ("sender", "receiver"):
        halves = list(dict.fromkeys(getattr(t, side) for t in transports()))
        declared = [m for half in halves for m in half.messages]
        assert len(declared) == len(set(declared)), side


def test_a_message_nobody_declared_is_refused_with_the_fix(fresh_registry) -> None:
    inbox, outbox = _inbox(), WeightOutbox(None, rank=0, version=lambda: 0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"expected a runner message \(.*LoadWeights.*\), got PutBuckets. Fix:"):
        asyncio.run(inbox.handle(PutBuckets()))  # a learner's message sent to a runner
    with pytest.raises(TypeError, match=r"expected a learner message \(.*PutBuckets.*\), got EndTransfer. Fix:"):
        outbox.handle(EndTransfer(3))
    # a streamed update after the runner stopped loads nothing: the shm receiver got it, not the push one
    inbox.close()
    assert asyncio.run(inbox.handle(LoadWeights(1, {}))) == -1


def test_a_new_transport_is_one_file_and_one_registry_line(tmp_path, monkeypatch, fresh_registry) -> None:
    (tmp_path / "echo_transport.py").write_text(ECHO_TRANSPORT)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(registry.TRANSPORTS, "echo", Registration("echo_transport:EchoTransport"))
    from echo_transport import Ping, Send

    inbox = _inbox()
    assert asyncio.run(inbox.handle(Ping("ab"))) == "abab"
    outbox = WeightOutbox(None, rank=2, version=lambda: 0)  # type: ignore[arg-type]
    assert outbox.handle(Send()) == ("sent by rank", 2)
    with pytest.raises(RuntimeError, match="Push before StartPush"):
        outbox.handle(Push())  # the registered transports are all still there
    route = route_for({"weight_sync": "echo"}, wait_for_load=False, bucket_bytes=64)
    assert route.name == "echo" and route.bucket_bytes == 64 and route.push(None, None) == 1.5  # type: ignore[arg-type]
