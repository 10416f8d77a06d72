"""flashrl: FlashREINFORCE, critic-free asynchronous RL with one rollout per prompt."""

__version__ = "0.1.0"
