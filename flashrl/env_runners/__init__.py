"""EnvRunner actors: engines + environments that stream finished episodes to the learner, and the
episode stream (`EpisodeStream`) that turns them into batches."""

from flashrl.env_runners.env_runner import EnvRunner
from flashrl.env_runners.group import EnvRunnerGroup, EnvRunnerGroupError
from flashrl.env_runners.rollout import EnvError, play_episode, skip_reason
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
    "RunnerReport",
    "play_episode",
    "skip_reason",
    "stream_seed",
]
