"""A new reward for flashrl/Math-v0: a user verifier, given as env_config["reward_fn"].

`reward_fn(reply, task)` gets the model's reply and the `MathTask` (its `question`, `answer`,
`prompt_id`) and returns a float (success = reward > 0) or a `VerifyResult`. Here: flashrl's own
answer check, with a bonus for a short reply. Pass the function itself, or its path
("my_package.rewards:brief_and_right") when the config must stay plain text (Tune, checkpoints).
The function is shipped to the EnvRunner actors by value and runs in their threads: keep it
thread-safe.

    python examples/extending/new_reward.py [--model smollm2-135m-instruct] [--iterations 2]
"""

from __future__ import annotations

from flashrl.envs.math import verify_answer

BONUS = 0.25


def brief_and_right(reply, task):
    """1 for a right answer (flashrl's verifier), plus BONUS when the reply has at most 8 words."""
    right = verify_answer(reply, task.answer).correct
    return float(right) + (BONUS if right and len(reply.split()) <= 8 else 0.0)


def main(argv=None):
    from common import run

    results = run(lambda config: config.environment(
        "flashrl/Math-v0", env_config={"preset": "easy_sums", "reward_fn": brief_and_right}), argv)
    print("mean return per iteration:", [round(r["env_runners/episode_return_mean"], 3) for r in results])
    return results


if __name__ == "__main__":
    main()
