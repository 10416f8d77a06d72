"""The learner side of training: batches, the generic update, and data-parallel (FSDP2) learner groups.

The learner is generic (RLlib style): the algorithm supplies its loss as a ``Loss`` object
(``flashrl.learners.loss``), e.g. FlashREINFORCE's ``FlashReinforceLossSpec``::

    from flashrl.algorithms.flash_reinforce.learner_loss import FlashReinforceLossSpec
    from flashrl.learners import LearnerGroup, LearnerSpec, TrainBatch

    spec = LearnerSpec(model=path, lr=1e-6, max_tokens_per_micro_batch=8192, loss=FlashReinforceLossSpec(delta=0.01))
    group = LearnerGroup(spec, num_learners=2)  # Ray actors, the policy sharded over them
    metrics = group.update(TrainBatch.from_episodes(episodes, pad_token_id=tokenizer.pad_token_id))
    weights = group.sync_weights(PutBuckets())  # object refs, one per bucket (flashrl.weight_sync.messages)
    group.save_policy("policy/")           # a Hugging Face folder that transformers and vLLM load
    group.shutdown()
"""

from flashrl.learners.batch import TrainBatch
from flashrl.learners.group import LearnerGroup, LearnerGroupError
from flashrl.learners.learner import Learner
from flashrl.learners.loss import BatchContext, Loss, LossMetrics, MicroBatch
from flashrl.learners.schedule import LR_SCHEDULES
from flashrl.learners.spec import OPTIMIZERS, LearnerSpec, register_optimizer

__all__ = [
    "LR_SCHEDULES",
    "OPTIMIZERS",
    "BatchContext",
    "Learner",
    "LearnerGroup",
    "LearnerGroupError",
    "LearnerSpec",
    "Loss",
    "LossMetrics",
    "MicroBatch",
    "TrainBatch",
    "register_optimizer",
]
