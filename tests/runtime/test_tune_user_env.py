"""A user's own script, as README shows it: an env defined in the script (``__main__``), registered with
``gymnasium.register``, swept with ``tune.Tuner(FlashReinforce, param_space=config)``. Every trial runs
(a trial's process never ran the script's ``gymnasium.register``), and flashrl's outputs of each trial sit
in the trial's folder under ``storage_path``.

The script runs in its own Python process (its ``__main__`` is the user's), which starts its own Ray
cluster; this test therefore needs no ``ray_session``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.ray

SCRIPT = textwrap.dedent('''
    import json
    import sys

    import gymnasium as gym
    import ray
    from ray import tune

    from flashrl.algorithms import FlashReinforce, FlashReinforceConfig
    from flashrl.envs.base import LanguageEnv


    class GuessNumber(LanguageEnv):
        """Guess a number from 0 to `high`: reward 1 for the number, else 0."""

        def __init__(self, high: int = 9) -> None:
            super().__init__(max_turns=1)
            self.high = high

        def _reset_task(self, options):
            self.secret = int(self.np_random.integers(self.high + 1))
            return [{"role": "user", "content": f"Guess my number from 0 to {self.high}."}], {"prompt_id": f"guess-{self.secret}"}

        def _step_action(self, action):
            return [], float(action.strip() == str(self.secret)), True, False, {}


    gym.register("newuser/GuessNumber-v0", entry_point=GuessNumber)

    model, storage = sys.argv[1], sys.argv[2]
    config = FlashReinforceConfig(
        num_env_runners=1, num_cpus_per_env_runner=0.25, engine="torch", episodes_in_flight_per_env_runner=4,
        max_new_tokens=8, max_episode_tokens=256, sample_timeout_s=120.0, num_learners=0, num_cpus_per_learner=0.25,
        model=model, train_batch_size=4, lr=1e-3, grad_clip=1.0, console_every=0, checkpoint_frequency=1,
        num_cpus_for_main_process=0.25,
    ).environment("newuser/GuessNumber-v0", env_config={"high": 3})
    config.training(delta=tune.grid_search([0.5, 1.0]))
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}})
    grid = tune.Tuner(
        FlashReinforce,
        param_space=config,
        tune_config=tune.TuneConfig(max_concurrent_trials=2),
        run_config=tune.RunConfig(storage_path=storage, stop={"training_iteration": 1}, verbose=0),
    ).fit()
    print("RESULT " + json.dumps({
        "errors": [str(result.error) for result in grid if result.error],
        "trials": [{"path": result.path, "delta": (result.config or {}).get("delta"),
                    "iteration": (result.metrics or {}).get("training_iteration")} for result in grid],
    }))
''')


def test_a_sweep_over_an_env_registered_in_the_users_script_runs_and_writes_into_the_trial_folders(
        tiny_llama_path, tmp_path):
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT)
    storage = tmp_path / "storage"
    run = subprocess.run(
        [sys.executable, str(script), tiny_llama_path, str(storage)],
        check=False, cwd=tmp_path, capture_output=True, text=True, timeout=900,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])},
    )
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-4000:]
    report = json.loads(lines[-1].removeprefix("RESULT "))
    assert report["errors"] == []
    assert sorted(t["delta"] for t in report["trials"]) == [0.5, 1.0]
    for trial in report["trials"]:
        folder = trial["path"]
        assert trial["iteration"] == 1
        assert os.path.dirname(os.path.dirname(folder)) == str(storage)  # <storage_path>/<experiment>/<trial>
        assert os.path.isfile(os.path.join(folder, "result.json"))  # Tune's own
        with open(os.path.join(folder, "results", "progress.jsonl"), encoding="utf-8") as f:
            assert [json.loads(line)["training_iteration"] for line in f] == [1]
        assert os.path.isfile(os.path.join(folder, "results", "progress.csv"))
        assert any(name.startswith("events.out.tfevents") for name in os.listdir(os.path.join(folder, "tensorboard")))
        assert os.path.isdir(os.path.join(folder, "checkpoints", "checkpoint_000001", "policy"))
        assert os.path.isfile(os.path.join(folder, "checkpoints", "latest"))
