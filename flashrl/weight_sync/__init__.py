"""Weight sync: how each new policy version gets from the learners into the env runners' engines.

This package owns the protocol end to end. The interfaces:

- ``transport``: what a transport is (``Transport``: its learner half, its runner half, the
  driver's ``WeightSyncRoute``, what a vLLM engine needs to start with it);
- ``sender``: a transport's learner half (``WeightSender``) and the ``WeightExtractor`` it sends
  from (the learners hand theirs in: ``flashrl.learners.weight_gather.PolicyWeights``);
- ``receiver``: a transport's runner half (``WeightReceiver``), sharing the runner's engine and lock;
- ``endpoints``: the one door on each side (``WeightOutbox`` behind ``Learner.sync_weights``,
  ``WeightInbox`` behind ``EnvRunner.weight_sync``), routing typed messages by their type;
- ``registry``: the transports by name (``TRANSPORTS``: one line each).

One file per transport: ``shm`` (object-store buckets pulled by the runners; also the bucket files a
vLLM engine hands its workers), ``nccl`` and ``ipc`` (pushed through vLLM's weight-transfer engines;
their shared halves are ``push``, their protocol and messages ``vllm_push``).

Underneath: ``wire`` (what crosses between the two sides: ``TensorMeta``, ``WeightManifest``,
``WeightBuckets``, ``WeightEntry``, the constants; no flashrl, no torch), ``messages`` (the streamed
weights' ``PutBuckets`` / ``LoadWeights``, every transport's fallback), ``buckets`` (cutting and
checking a stream), ``resolve`` (an engine's ``weight_sync`` option resolved to a transport),
``layout`` (the transport a run's resource layout allows) and ``route`` (``route_for``: the driver's
choice from the runners' facts).

This package sits below the learners, the engines and the env runners and imports none of them.
The submodules are imported by name: this package imports nothing itself, so that reading an
engine option (``resolve``) needs no torch.
"""
