"""The learner side of training: batches, the policy's update, and data-parallel learner groups.

::

    from flashrl.learners import LearnerGroup, LearnerSpec, TrainBatch

    group = LearnerGroup(LearnerSpec(model=path, lr=1e-6, delta=0.01), num_learners=2)  # Ray actors
    metrics = group.update(TrainBatch.from_episodes(episodes, pad_token_id=tokenizer.pad_token_id))
    weights_ref = group.get_weights_ref()  # one object-store ref for every engine's update_weights
    group.save_policy("policy/")           # a Hugging Face folder that transformers and vLLM load
    group.shutdown()
"""

from flashrl.learners.batch import TrainBatch
from flashrl.learners.group import LearnerGroup, LearnerGroupError
from flashrl.learners.learner import Learner
from flashrl.learners.schedule import LR_SCHEDULES
from flashrl.learners.spec import OPTIMIZERS, LearnerSpec, register_optimizer

__all__ = [
    "LR_SCHEDULES",
    "OPTIMIZERS",
    "Learner",
    "LearnerGroup",
    "LearnerGroupError",
    "LearnerSpec",
    "TrainBatch",
    "register_optimizer",
]
