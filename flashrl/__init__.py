"""flashrl: FlashREINFORCE, critic-free asynchronous RL with one rollout per prompt."""

from flashrl.terminal_text import install_log_escaping

__version__ = "0.1.0"

install_log_escaping()  # model text in a flashrl log line reaches a terminal inert (flashrl/terminal_text.py)
