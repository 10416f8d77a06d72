"""EnvRunner actors: engines + environments that stream finished episodes to the learner, and the
episode stream (`EpisodeStream`) that turns them into batches."""

from flashrl.env_runners.env_runner import EnvRunner
from flashrl.env_runners.group import EnvRunnerGroup, EnvRunnerGroupError
from flashrl.env_runners.rollout import play_episode, skip_reason
from flashrl.env_runners.rollout_protocol import EnvError, Rollout, RolloutContext
from flashrl.env_runners.rollouts import register_rollout
from flashrl.env_runners.spec import EnvRunnerSpec
from flashrl.env_runners.stream import CollectedBatch, EpisodeStream
from flashrl.env_runners.types import EVAL_STREAM, SKIP_REASONS, TRAIN_STREAM, RunnerReport
from flashrl.seeds import stream_seed

__all__ = [
    "EVAL_STREAM",
    "SKIP_REASONS",
    "TRAIN_STREAM",
    "CollectedBatch",
    "EnvError",
    "EnvRunner",
    "EnvRunnerGroup",
    "EnvRunnerGroupError",
    "EnvRunnerSpec",
    "EpisodeStream",
    "Rollout",
    "RolloutContext",
    "RunnerReport",
    "play_episode",
    "register_rollout",
    "skip_reason",
    "stream_seed",
]
