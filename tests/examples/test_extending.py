"""The examples of docs/extending.md (examples/extending/*.py) train one iteration on the tiny model.

Each example file is imported from its folder (as `python examples/extending/<name>.py` would run it)
and its `main` is run on the session's Ray cluster: its env, reward or baseline reaches the actors by
value, since the actors cannot import the examples folder.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray

FOLDER = Path(__file__).resolve().parents[2] / "examples" / "extending"
EXAMPLES = ("new_environment", "new_reward", "new_baseline")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, FOLDER / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as a script's module is: cloudpickle finds it there
    spec.loader.exec_module(module)
    return module


def test_every_example_file_is_tested():
    # callback_metric.py has its own test (tests/examples/test_callback_metric.py); common.py is shared code.
    assert sorted(p.stem for p in FOLDER.glob("*.py") if p.stem not in ("common", "callback_metric")) == sorted(EXAMPLES)
    assert (Path(__file__).parent / "test_callback_metric.py").is_file()


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_trains_an_iteration(name, ray_cluster, tiny_llama_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(FOLDER))  # the script's folder, for its `from common import run`
    module = sys.modules.get(name) or _load(name)
    (result,) = module.main(["--model", tiny_llama_path, "--iterations", "1"])
    assert result["learners/version"] == 1
    assert result["num_episodes"] == 4
    printed = capsys.readouterr().out
    assert "per iteration: [" in printed
    if name == "new_reward":  # rewards are 0, 1 or 1.25: a return mean over 4 episodes is a multiple of 1/16
        assert (result["env_runners/episode_return_mean"] * 16) == pytest.approx(
            round(result["env_runners/episode_return_mean"] * 16))
    if name == "new_baseline":  # A = R - median(R): for R in {0, 1}, the mean is the mean minus the median
        r = result["learners/reward_mean"]
        assert result["learners/advantage_mean"] == pytest.approx(r - (1.0 if r > 0.5 else 0.0), abs=1e-6)
