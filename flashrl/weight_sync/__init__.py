"""Weight sync: how each new policy version gets from the learners into the env runners' engines.

- ``wire``: what crosses between the two sides, defined once (``TensorMeta``, ``WeightManifest``,
  ``WeightBuckets``, ``WeightEntry``, ``DEFAULT_BUCKET_BYTES`` and the transfer constants); it
  imports nothing of flashrl and no torch.
- ``buckets``: weights as a stream of bounded buckets (cutting a manifest, checking a stream).
- ``shm``: the shared-memory files that carry one bucket from an engine's process to its vLLM workers.
- ``resolve``: an engine's ``weight_sync`` option resolved to a route (``shm``, ``nccl``, ``ipc``).
- ``layout``: the route a run's resource layout allows, planned before the engines start and checked after.
- ``vllm_push``: the push routes' protocol (vLLM's client over the env runners, init info, deadlines).
- ``receiver``: an env runner's side (``WeightReceiver``: streamed and pushed updates into its engine).
- ``route``: a run's route behind one interface (``WeightSyncRoute``), chosen from the runners' facts.

The learner's side (``WeightSender``, and gathering a possibly sharded policy into buckets) is
``flashrl.learners.weight_sender`` and ``flashrl.learners.weight_gather``: this package sits below
the learners, the engines and the env runners and imports none of them.

The submodules are imported by name: this package imports nothing itself, so that reading an
engine option (``resolve``) needs no torch.
"""
