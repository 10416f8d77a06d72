"""The run's memory plan warns when the learner's and the env runners' estimates exceed the node's memory:
in the dry run (the node plan's RAM) and at a normal start (this machine's), naming the settings to change."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from flashrl.plan import plan_run
from flashrl.plan.memory import GIB
from flashrl.recipes import plan
from flashrl.recipes.preset import NodePlan
from flashrl.recipes.run import build_config, train

EXAMPLE = Path(__file__).resolve().parents[2] / "tuned_examples" / "smollm2_python_tool_cpu.py"


def _tool_job(tmp_path):
    spec = importlib.util.spec_from_file_location("_tool_job", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config, _ = build_config(module.PRESET, module.make_config, ["--output", str(tmp_path)])
    return module.PRESET, config


def _need(config) -> int:
    """The tool job's estimate: one learner on CPU (all of it) + one env runner's engine."""
    run_plan = plan_run(config)
    return run_plan.learner_memory.total + run_plan.runner_memory.total


def test_the_warning_starts_one_byte_below_the_estimate_and_names_the_fix(tmp_path):
    _, config = _tool_job(tmp_path)
    run_plan = plan_run(config)
    need = _need(config)
    assert plan.node_memory_warning(config, run_plan, need) is None
    warning = plan.node_memory_warning(config, run_plan, need - 1)
    assert warning.startswith("host memory: the learner (")
    assert "plus 1 env runner(s)" in warning and "Fix: " in warning
    assert "max_tokens_per_micro_batch (now 2048" in warning and "episodes_in_flight_per_env_runner (now 16)" in warning


def test_the_dry_run_warns_on_a_node_too_small_for_learner_and_runners(tmp_path):
    preset, config = _tool_job(tmp_path)
    need = _need(config)
    # above the learner with its checkpoint save, below the learner plus the runner
    learner = plan_run(config).learner_memory.total
    assert learner < need - 1
    small = NodePlan(num_nodes=1, gpus_per_node=0, cpus_per_node=2, host_memory_gib=(need - 1) / GIB)
    warnings = plan.dry_run_report(preset, config, small).warnings
    assert [w for w in warnings if w.startswith("host memory: the learner")]
    roomy = NodePlan(num_nodes=1, gpus_per_node=0, cpus_per_node=2, host_memory_gib=(need + GIB) / GIB)
    assert not [w for w in plan.dry_run_report(preset, config, roomy).warnings if w.startswith("host memory")]


def test_a_normal_start_prints_the_warning_against_this_machines_memory(tmp_path, monkeypatch, capsys):
    preset, config = _tool_job(tmp_path)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(plan, "machine_memory_bytes", lambda: 2 * GIB)

    class Stop(Exception):
        pass

    def no_run(self):
        raise Stop

    monkeypatch.setattr(type(config), "build_algo", no_run)
    with pytest.raises(Stop):
        train(config, preset, stop_iters=1, stop_reward=1.0, output=str(tmp_path / "run"))
    err = capsys.readouterr().err
    assert "WARNING: host memory: the learner (" in err and "above the node's 2.00 GiB" in err
