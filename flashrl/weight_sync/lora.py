"""The ``lora`` transport: a LoRA learner's adapter, and nothing else, through the object store.

A run that trains a LoRA adapter (``LearnerSpec.lora_rank``) takes this route (the run plan,
``flashrl.plan.run_plan``, sets the engines' ``weight_sync`` to ``lora`` and gives them the adapter's
settings as the engine option ``lora``). The engines hold the frozen base model from their start;
each new policy version is its adapter: megabytes where a full push is the whole model.

- The learner half (``AdapterSender``, ``PutAdapter``): every rank gathers the adapter's tensors (the
  learner's weight extractor selects them, ``flashrl.models.lora.is_adapter_name``) into object-store
  buckets as ``shm`` does; the sender refuses to send a tensor that is not an adapter's, so a base
  weight never crosses.
- The runner half: ``shm``'s ``StreamReceiver``. The adapter arrives as a ``LoadWeights`` stream, the
  message every transport falls back to, so a restarted runner and a checkpoint restore load it the
  same way; an engine started with the option ``lora`` reads a stream as its adapter (the torch
  engine copies it into its peft-injected model; vLLM writes it as a PEFT folder and serves it as a
  new ``LoRARequest`` of that version).
- The driver's side (``AdapterRoute``): ``shm``'s route whose stream is the adapter (``PutAdapter``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from flashrl.models.lora import is_adapter_name
from flashrl.weight_sync.sender import LearnerMessage, WeightSender
from flashrl.weight_sync.shm import ShmRoute, StreamReceiver, put_buckets
from flashrl.weight_sync.transport import Learners, Transport
from flashrl.weight_sync.wire import DEFAULT_BUCKET_BYTES, WeightBuckets

__all__ = ["AdapterRoute", "AdapterSender", "LoraTransport", "PutAdapter"]


@dataclass(frozen=True)
class PutAdapter(LearnerMessage):
    """To every learner rank: put the LoRA adapter's tensors into the object store, bucket by bucket.

    Answer: a ``WeightBuckets`` of object refs holding only adapter tensors (rank 0; None on the other
    ranks). The names are the learner's state-dict names (``...q_proj.lora_A.default.weight``).
    """

    bucket_bytes: int = DEFAULT_BUCKET_BYTES


class AdapterSender(WeightSender):
    """A LoRA learner rank's adapter into the object store (``PutAdapter``)."""

    messages = (PutAdapter,)

    def handle(self, message: PutAdapter) -> WeightBuckets | None:  # type: ignore[override]
        manifest = self.weights.manifest(message.bucket_bytes, "model")
        others = [m.name for bucket in manifest for m in bucket if not is_adapter_name(m.name)]
        if not manifest or others:
            raise ValueError(
                f"lora weight sync: expected the learner to send only its LoRA adapter (lora_A / lora_B tensors), "
                f"got {len(others)} other tensors (e.g. {others[:2]}) of {sum(len(b) for b in manifest)}. Fix: "
                "train with lora_rank set (the learner then selects its adapter), or use weight_sync='shm' for "
                "full training."
            )
        return put_buckets(self.weights, bucket_bytes=message.bucket_bytes, names="model", is_sender=self.rank == 0)


class AdapterRoute(ShmRoute):
    """``shm``'s route with the adapter as its stream (each push, and the load after a restore)."""

    name = "lora"

    def stream(self, learners: Learners) -> Any:
        return learners.sync_weights(PutAdapter(self.bucket_bytes))


class LoraTransport(Transport):
    """``lora``: the adapter of a LoRA learner, for CPU and GPU engines alike (they keep their base)."""

    name: ClassVar[str] = "lora"
    sender = AdapterSender
    receiver = StreamReceiver

    def route(self, facts: Mapping[str, Any], *, wait_for_load: bool, bucket_bytes: int) -> AdapterRoute:
        return AdapterRoute(wait_for_load=wait_for_load, bucket_bytes=bucket_bytes)
