"""A new environment: a Gymnasium language env, registered under an id, trained on.

A language environment is a `flashrl.envs.LanguageEnv`: `reset` gives the prompt as chat messages,
`step` takes the model's reply text and returns the next messages, the reward, the end flags and an
info dict (`info["success"]`, a bool, is the env's success label). Here: the model is asked for a
word of a given length and earns 1 when its reply's first word has it.

    python examples/extending/new_environment.py [--model smollm2-135m-instruct] [--iterations 2]
"""

from __future__ import annotations

import gymnasium as gym

from flashrl.envs import LanguageEnv


class WordLengthEnv(LanguageEnv):
    """Single turn: "Say a word of N letters." Reward 1 when the reply's first word has N letters."""

    def __init__(self, max_letters: int = 6) -> None:
        super().__init__(max_turns=1)
        self.max_letters = max_letters
        self.letters = 0

    def _reset_task(self, options):
        self.letters = int(self.np_random.integers(2, self.max_letters + 1))
        prompt = [{"role": "user", "content": f"Say one English word of exactly {self.letters} letters."}]
        return prompt, {"prompt_id": f"letters-{self.letters}"}

    def _step_action(self, action):
        words = action.split()
        success = bool(words) and len(words[0].strip(".,!?\"'")) == self.letters
        return [], float(success), True, False, {"success": success}


# Registered in this script only: the EnvRunner actors receive the class by value (they need not
# import this file), so a script, a notebook or a test file can define its env.
gym.register("examples/WordLength-v0", entry_point=WordLengthEnv)


def main(argv=None):
    from common import run

    results = run(lambda config: config.environment("examples/WordLength-v0", env_config={"max_letters": 5}),
                  argv)
    print("mean return per iteration:", [round(r["env_runners/episode_return_mean"], 3) for r in results])
    return results


if __name__ == "__main__":
    main()
