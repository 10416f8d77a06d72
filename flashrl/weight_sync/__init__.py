"""Weight sync: how each new policy version gets from the learners into the env runners' engines.

- ``buckets``: weights as a stream of bounded buckets (``WeightBuckets``) and its manifest
  (``WeightManifest``: the tensors of every bucket, declared before any data moves).
- ``gather``: the learner's side, the policy gathered bucket by bucket into the object store.
- ``shm``: the shared-memory files that carry one bucket from an engine's process to its vLLM workers.
- ``resolve``: an engine's ``weight_sync`` option resolved to a route (``shm``, ``nccl``, ``ipc``).
- ``vllm_push``: the push routes' learner side (vLLM's trainer weight-transfer engines).
- ``route``: a run's route behind one interface (``WeightSyncRoute``), chosen from the runners' facts.

The submodules are imported by name: this package imports nothing itself, so that reading an
engine option (``resolve``) needs no torch.
"""
