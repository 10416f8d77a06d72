"""Each benchmark's --quick mode end to end (tiny random model, torch engine): its JSON and figure.

The numbers of a quick run mean nothing (a random model never adds); what is checked is that the
report has its schema, that the budgets are the ones promised and that every number is finite.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray


def _numbers(value, path="$"):
    """Every number in a JSON value, with its path."""
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        yield path, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _numbers(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _numbers(v, f"{path}[{i}]")


def _load(path: Path) -> dict:
    def refuse(name):
        raise AssertionError(f"{path}: non-standard JSON constant {name}")

    report = json.loads(path.read_text(), parse_constant=refuse)
    bad = [(p, v) for p, v in _numbers(report) if not math.isfinite(v)]
    assert not bad, bad
    return report


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _figure(path: Path) -> None:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path


def test_learning_efficiency_quick(ray_cluster, bench, tmp_path):
    out, fig = tmp_path / "le.json", tmp_path / "le.png"
    tb = tmp_path / "tb"
    bench("learning_efficiency").main(
        ["--quick", "--output", str(out), "--figure", str(fig), "--tensorboard", str(tb)]
    )
    report = _load(out)
    _figure(fig)
    _figure(tmp_path / "le_training.png")
    for method in ("flash_reinforce", "grpo"):  # one TensorBoard run per method and seed
        assert list((tb / "learning_efficiency" / method / "seed0").glob("events.out.tfevents.*")), method
    assert report["benchmark"] == "learning_efficiency"
    assert report["settings"]["seeds"] == [0] and report["settings"]["rollouts_per_update"] == 4
    assert report["methods"]["grpo"]["overrides"]["rollout_mode"] == "sync_group"
    assert report["methods"]["grpo"]["config"]["group_size"] == 4
    assert report["methods"]["flash_reinforce"]["config"]["model"] == "tiny"  # the spec, not a local folder
    assert sorted((r["method"], r["seed"]) for r in report["runs"]) == [("flash_reinforce", 0), ("grpo", 0)]
    for run in report["runs"]:
        assert run["missing_metrics"] == []
        # evaluated before training and after each of the 2 updates, at equal rollout budgets
        assert [(p["update"], p["rollouts"]) for p in run["curve"]] == [(0, 0), (1, 4), (2, 8)]
        assert all(0.0 <= p["accuracy"] <= 1.0 and p["num_episodes"] == 8 for p in run["curve"])
        assert run["summary"]["rollouts_trained"] == 8
    for method in ("flash_reinforce", "grpo"):
        s = report["summary"][method]
        for key in ("initial_accuracy", "final_accuracy", "curve_mean_accuracy", "accepted_fraction"):
            assert _is_number(s[key]["mean"]) and s[key]["n"] == 1, (method, key)
        assert [p["update"] for p in s["curve"]] == [0, 1, 2]
        assert s["seeds_reaching_target"] in (0, 1)
    assert set(report["ratios"]) == {
        "final_accuracy_flash_over_grpo",
        "curve_mean_accuracy_flash_over_grpo",
        "rollouts_to_target_grpo_over_flash",
    }


@pytest.mark.slow  # 9 arms, each a fresh algorithm: about 90 s on 2 cores
def test_ablations_quick(ray_cluster, bench, tmp_path):
    out, fig = tmp_path / "ab.json", tmp_path / "ab.png"
    module = bench("ablations")
    module.main(
        ["--quick", "--output", str(out), "--figure", str(fig), "--tensorboard", str(tmp_path / "tb")]
    )
    report = _load(out)
    _figure(fig)
    _figure(tmp_path / "ab_training.png")
    assert list((tmp_path / "tb" / "ablations" / "no_trust@Q8" / "seed0").glob("events.out.tfevents.*"))
    assert list(report["summary"]) == module.ARM_NAMES
    assert report["arms"]["no_trust@Q8"]["config"]["delta"] == "inf"
    for name, s in report["summary"].items():
        for key in ("final_accuracy", "accepted_fraction", "drift_mean", "policy_lag_mean", "policy_lag_max"):
            assert _is_number(s[key]["mean"]), (name, key)
        assert 0.0 <= s["accepted_fraction"]["mean"] <= 1.0
    for q in (4, 8):
        config = report["arms"][f"flash_reinforce@Q{q}"]["config"]
        assert (config["async_queue_size"], config["episodes_in_flight_per_env_runner"]) == (q, q * 4)
        assert report["summary"][f"no_trust@Q{q}"]["policy_lag_max"]["max"] <= q
    for run in report["runs"]:
        assert run["missing_metrics"] == [] and run["summary"]["rollouts_trained"] == 8
        assert [p["update"] for p in run["curve"]] == [0, 2]


def test_async_vs_sync_quick(ray_cluster, bench, tmp_path):
    out = tmp_path / "avs.json"
    bench("async_vs_sync").main(["--quick", "--output", str(out)])
    report = _load(out)
    runs = report["runs"]
    for name in ("num_env_runners", "episodes_in_flight_per_env_runner", "train_batch_size"):
        assert report["configs"]["async"][name] == report["configs"]["sync_group"][name], name
    assert report["configs"]["async"]["episodes_in_flight_per_env_runner"] == 4  # B = 8 over 2 runners
    assert runs["async"]["episodes_into_learner"] == runs["sync_group"]["episodes_into_learner"] == 16
    assert runs["sync_group"]["episodes_sampled"] == 16
    # async counts the episodes started after the warmup: up to B = 8 that were already in flight when
    # it ended are trained but not counted, the refills of the last update may not be reported yet, and
    # at the end up to 8 more can be in flight and 8 finished ones buffered (K = 4 per runner)
    assert 16 - 8 <= runs["async"]["episodes_sampled"] <= 16 + 8 + 8
    for run in runs.values():
        assert run["iterations"] == 2 and run["missing_metrics"] == []
        assert sum(run["policy_lag_distribution"].values()) == pytest.approx(1.0)
        assert 0.0 <= run["learner_idle_fraction"] <= 1.0
    assert runs["sync_group"]["policy_lag_max"] == 0  # on-policy
    for key in ("trajectories_per_s", "learner_idle_fraction", "iteration_s"):
        assert _is_number(report["ratios_async_over_sync"][key]), key


def test_ablations_add_seeds_to_a_committed_report(ray_cluster, bench, tmp_path):
    # a fresh clone: the report is there, its run log is not; --resume and --report-only build on it
    out, fig = tmp_path / "ab.json", tmp_path / "ab.png"
    module = bench("ablations")
    common = ["--quick", "--output", str(out), "--figure", str(fig), "--tensorboard", str(tmp_path / "tb")]
    first = module.main([*common, "--arms", "flash_reinforce"])
    Path(f"{out}.runs.tmp").unlink()

    report = module.main(
        [*common, "--arms", "flash_reinforce", "no_is", "--seeds", "0", "1", "--report-only"]
    )
    assert report["runs"] == first["runs"]  # kept as committed, nothing trained
    assert report["missing"] == [
        {"arm": "no_is", "seed": 0},
        {"arm": "flash_reinforce", "seed": 1},
        {"arm": "no_is", "seed": 1},
    ]
    assert list(report["summary"]) == ["flash_reinforce"] and report["summary"]["flash_reinforce"][
        "seeds"
    ] == [0]
    assert _load(out)["missing"] == report["missing"]

    with pytest.raises(ValueError, match="without --resume"):  # another scale cannot extend this report
        module.main([*common, "--updates", "3", "--resume"])
    with pytest.raises(SystemExit, match="no finished run"):
        module.main([*common[:1], "--output", str(tmp_path / "none.json"), "--report-only"])


def test_agentic_learning_quick(ray_cluster, bench, tmp_path):
    out, fig = tmp_path / "ag.json", tmp_path / "ag.png"
    report = bench("agentic_learning").main(["--quick", "--seeds", "0", "--output", str(out), "--figure", str(fig)])
    assert _load(out)["summary"]["num_seeds"] == 1
    _figure(fig)
    (run,) = report["runs"]
    assert run["missing_metrics"] == [] and [p["update"] for p in run["curve"]] == [0, 2]
    for point in run["curve"]:  # PythonTool reports tool calls; the turn limit is 2 replies
        assert 1.0 <= point["turns_mean"] <= 2.0 and point["tool_calls_mean"] is not None
    assert all(row["tool_calls_mean"] is not None and row["turns_mean"] >= 1 for row in run["updates"])
    for row in run["updates"]:  # the drops by reason, adding up to the count
        assert sum(row["skipped_by_reason"].values()) == row["skipped_lifetime"]
    assert report["config"]["env_config"]["tasks"]["source"].endswith("products()")
    assert report["config"]["engine"] == "torch" and report["config"]["train_batch_size"] == 4


def test_learner_dtype_quick(bench, tmp_path):
    out = tmp_path / "dtype.json"
    report = bench("learner_dtype").main(["--quick", "--output", str(out)])
    saved = _load(out)
    assert [r["dtype"] for r in saved["rows"]] == ["float32", "bfloat16"]
    assert all(len(r["update_s"]) == 1 and r["update_s_mean"] > 0 for r in saved["rows"])
    assert saved["speedup_bf16"] == pytest.approx(saved["rows"][0]["update_s_mean"] / saved["rows"][1]["update_s_mean"])
    agree = report["agreement"]  # bf16 rounds the same weights: log-probs move, but not by much
    assert agree["tokens"] == saved["batch"]["loss_tokens"] > 0
    assert 0 < agree["abs_logprob_diff_mean"] < 1 and 0 <= agree["bernoulli_kl_mean"] <= agree["trajectory_drift_max"]


@pytest.mark.slow  # 3 arms, each a fresh algorithm: about 90 s on 2 cores
def test_paired_comparison_quick(ray_cluster, bench, tmp_path):
    out, fig = tmp_path / "pc.json", tmp_path / "pc.png"
    report = bench("paired_comparison").main(
        ["--task", "sums", "--quick", "--seeds", "0", "--output", str(out), "--figure", str(fig)]
    )
    report = _load(out)
    _figure(fig)
    assert report["settings"]["budget"] == 16 and report["settings"]["held_out"] == 8
    assert sorted(r["arm"] for r in report["runs"]) == ["flash_async", "flash_sync", "grpo"]
    for run in report["runs"]:
        # every run spent at least the budget in generated rollouts, and stopped at the first update that did
        generated = [p["generated"] for p in run["curve"]]
        assert generated[0] == 0 and generated[-1] >= 16 and generated[-2] < 16, generated
        assert 0.0 <= run["metrics"]["area"] <= 1.0 and run["metrics"]["accuracy_at_budget"] is not None
    sync = next(r for r in report["runs"] if r["arm"] == "flash_sync")
    assert sync["rollout_mode"] == "sync_group" and [p["generated"] for p in sync["curve"]] == [0, 4, 8, 12, 16]
    assert set(report["comparisons"]) == {"flash_async - grpo", "flash_async - flash_sync", "flash_sync - grpo"}


def test_agentic_learning_quick_runs_the_agent_job(ray_cluster, bench, tmp_path):
    out, fig = tmp_path / "agent.json", tmp_path / "agent.png"
    report = bench("agentic_learning").main(["--quick", "--job", "agent", "--seeds", "0", "--output", str(out),
                                             "--figure", str(fig)])
    assert report["settings"]["job"].endswith("agent_tool_job.py") and report["settings"]["agent"] == "multiply"
    assert report["config"]["env_config"]["agent"].endswith(":multiply>")  # the agent function, shipped by value
    assert (report["config"]["agent_max_calls"], report["config"]["agent_wall_time_s"]) == (2, 600.0)  # the runner's
    (run,) = report["runs"]
    assert run["missing_metrics"] == [] and [p["update"] for p in run["curve"]] == [0, 2]
    for point in run["curve"]:  # one or two model calls, as the agent makes them; the endpoint counts tool calls
        assert 1.0 <= point["turns_mean"] <= 2.0 and point["tool_calls_mean"] is not None


def test_agent_prompt_probe_quick(bench, tmp_path):
    out = tmp_path / "probe.json"
    report = bench("agent_prompt_probe").main(["--quick", "--output", str(out)])
    saved = _load(out)
    assert saved["quick"] is True and saved["model"] == "tiny" and saved["shipped"] == "examples_2"
    assert list(saved["prompts"]) == ["system_one_shot", "examples_1", "examples_2", "examples_3"]
    tokens = [row["prompt_tokens"] for row in report["prompts"].values()]
    assert tokens[1] < tokens[2] < tokens[3]  # each worked example adds its turns to the same rendering
    for row in saved["prompts"].values():
        assert row["samples"] == 2 and len(row["examples"]) == 2
        for key in ("tool_calls", "right_code", "direct_correct", "boxed_question"):
            assert 0 <= row[key] <= row["samples"], key
        assert row["tool_call_fraction"] == row["tool_calls"] / 2


@pytest.mark.slow  # 2 runs, each its own process and local Ray: about 90 s on 2 cores
def test_lora_learning_quick(bench, tmp_path):
    out = tmp_path / "lora.json"
    bench("lora_learning").main(["--quick", "--output", str(out)])
    report = _load(out)
    assert report["settings"]["seeds"] == [0] and report["arms"]["lora"]["overrides"]["lora_rank"] == 16
    assert report["arms"]["lora"]["config"]["lora_rank"] == 16 and report["arms"]["full"]["config"]["lora_rank"] is None
    runs = {r["arm"]: r for r in report["runs"]}
    for run in runs.values():
        assert run["missing_metrics"] == [] and [(p["update"], p["rollouts"]) for p in run["curve"]] == [(0, 0), (1, 4)]
        assert run["process_peak_rss_mib"] > 100 and _is_number(run["weight_sync_s_mean"])
    # the tiny model's float32 weights (a tied head once), and its rank-16 adapter in float32: 2 layers x
    # r x (in + out) of q, k, v, o, gate, up, down
    assert runs["full"]["push_bytes"] == 26_348_032 and runs["lora"]["push_bytes"] == 2 * 16 * 4 * sum(
        i + o for i, o in [(128, 128), (128, 64), (128, 64), (128, 128), (128, 256), (128, 256), (256, 128)])
    assert set(report["ratios"]) == {f"{k}_lora_over_full" for k in (
        "final_accuracy", "iteration_s", "weight_sync_s", "push_bytes", "process_peak_rss_mib")}


def test_lora_learning_figure_averages_each_arm_and_rate_over_its_seeds(bench, tmp_path):
    module = bench("lora_learning")

    def report(arm: str, lr: float, finals: list[float]) -> dict:
        runs = [{"arm": arm, "seed": s, "curve": [{"rollouts": 0, "accuracy": 0.25}, {"rollouts": 16, "accuracy": f}]}
                for s, f in enumerate(finals)]
        return {"arms": {arm: {"config": {"lr": lr}}}, "runs": runs}

    curves = module.figure_curves([report("full", 3e-6, [0.5, 0.25]), report("lora", 1e-4, [0.75, 0.5, 1.0])])
    assert curves == {
        "full lr 3e-06": [{"rollouts": 0, "mean": 0.25, "min": 0.25, "max": 0.25},
                          {"rollouts": 16, "mean": 0.375, "min": 0.25, "max": 0.5}],
        "LoRA r16 lr 0.0001": [{"rollouts": 0, "mean": 0.25, "min": 0.25, "max": 0.25},
                               {"rollouts": 16, "mean": 0.75, "min": 0.5, "max": 1.0}],
    }
