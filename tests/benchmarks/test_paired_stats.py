"""The pre-registered comparison's statistics and bookkeeping (benchmarks/_paired.py, paired_comparison.py),
against values computed by hand or taken from standard tables."""

from __future__ import annotations

import json
import math

import pytest
from _paired import (
    accuracy_at,
    area_to_budget,
    first_reaching,
    holm,
    paired_difference,
    sign_flip_p_value,
    t_quantile,
)


def test_area_cuts_the_curve_at_the_budget_by_interpolation():
    curve = [{"generated": 0, "accuracy": 0.3}, {"generated": 80, "accuracy": 0.5},
             {"generated": 500, "accuracy": 0.7}]
    # 0..80: 80 * 0.4 = 32; 80..480: accuracy at 480 is 0.5 + 0.2 * 400/420; 400 * (0.5 + that) / 2
    at_480 = 0.5 + 0.2 * 400 / 420
    assert accuracy_at(curve, 480) == pytest.approx(at_480)
    assert area_to_budget(curve, 480) == pytest.approx((32 + 400 * (0.5 + at_480) / 2) / 480)
    assert area_to_budget(curve, 80) == pytest.approx(0.4)


def test_area_refuses_a_curve_that_did_not_spend_the_budget_or_does_not_start_at_zero():
    with pytest.raises(ValueError, match="reaching generated = 480"):
        area_to_budget([{"generated": 0, "accuracy": 0.3}, {"generated": 400, "accuracy": 0.5}], 480)
    with pytest.raises(ValueError, match="starting at generated = 0"):
        area_to_budget([{"generated": 16, "accuracy": 0.3}, {"generated": 480, "accuracy": 0.5}], 480)


def test_first_reaching():
    curve = [{"generated": 0, "accuracy": 0.3}, {"generated": 96, "accuracy": 0.45}, {"generated": 192, "accuracy": 0.5}]
    assert first_reaching(curve, 0.45) == 96
    assert first_reaching(curve, 0.6) is None


@pytest.mark.parametrize(("df", "expected"), [(1, 12.706), (2, 4.303), (11, 2.201), (30, 2.042)])
def test_t_quantile_matches_the_tables(df, expected):
    assert round(t_quantile(0.975, df), 3) == expected


def test_sign_flip_p_value_by_enumeration():
    # sum 6: only +++ and --- reach |sum| >= 6 among 8 patterns
    assert sign_flip_p_value([1.0, 2.0, 3.0]) == 0.25
    # [1, 3]: |sum| >= 4 for ++ and -- only
    assert sign_flip_p_value([1.0, 3.0]) == 0.5
    assert sign_flip_p_value([1.0, -1.0]) == 1.0


def test_paired_difference_interval():
    out = paired_difference([0.1, 0.2, 0.3])
    se = math.sqrt(0.01 / 3)  # sample variance 0.01
    assert out["mean"] == pytest.approx(0.2) and out["std_error"] == pytest.approx(se)
    assert out["interval"] == pytest.approx([0.2 - 4.302653 * se, 0.2 + 4.302653 * se])
    assert out["p_value"] == 0.25
    assert paired_difference([0.1])["interval"] is None


def test_holm_is_step_down_and_monotone():
    assert holm({"a": 0.01, "b": 0.04, "c": 0.03}) == pytest.approx({"a": 0.03, "c": 0.06, "b": 0.06})


def test_pilot_choice_takes_the_best_mean_area_and_breaks_ties_toward_the_main_jobs_rate(bench):
    module = bench("paired_comparison")
    runs = [{"arm": "grpo", "lr": lr, "seed": s, "metrics": {"area": area}}
            for lr, areas in ((1e-6, (0.40, 0.42)), (3e-6, (0.45, 0.47)), (1e-5, (0.46, 0.4601)))
            for s, area in zip((100, 101), areas, strict=True)]
    choice = module.best_learning_rate(runs, "grpo")  # 3e-6: 0.460, 1e-5: 0.46005 -> a tie at 3 decimals
    assert choice["lr"] == 3e-6
    runs[-1]["metrics"]["area"] = 0.48
    assert module.best_learning_rate(runs, "grpo")["lr"] == 1e-5
    with pytest.raises(ValueError, match="expected 2 pilot runs at lr 1e-05, found 1"):
        module.best_learning_rate(runs[:-1], "grpo")


def test_schedule_rotates_the_arms_seed_by_seed(bench):
    module = bench("paired_comparison")
    task = module.TASKS["sums"]
    lrs = {"flash_async": 3e-6, "flash_sync": 1e-5, "grpo": 1e-6}
    order = module.schedule("sums", "counted", task, [0, 1, 2], lrs)
    assert [(arm, seed) for arm, _, seed in order] == [
        ("flash_async", 0), ("flash_sync", 0), ("grpo", 0),
        ("flash_sync", 1), ("grpo", 1), ("flash_async", 1),
        ("grpo", 2), ("flash_async", 2), ("flash_sync", 2),
    ]
    assert order[1][1] == 1e-5
    pilot = module.schedule("sums", "pilot", task, [100], lrs)
    assert len(pilot) == 9 and {lr for _, lr, _ in pilot} == {1e-6, 3e-6, 1e-5}


def test_compare_pairs_seeds_both_arms_have(bench):
    module = bench("paired_comparison")
    task = module.TASKS["tool"]
    runs = [{"arm": arm, "seed": seed, "metrics": {"area": area, "accuracy_at_budget": area + 0.1}}
            for arm, seed, area in (("flash_async", 0, 0.5), ("grpo", 0, 0.4), ("flash_async", 1, 0.6),
                                    ("grpo", 1, 0.3), ("flash_async", 2, 0.9))]
    out = module.compare(runs, task)["flash_async - grpo"]
    assert out["seeds"] == [0, 1] and out["area_differences"] == pytest.approx([0.1, 0.3])
    assert out["area"]["mean"] == pytest.approx(0.2) and out["area"]["p_value_holm"] == 0.5


def _pilot_run(arm, lr, seed, area):
    curve = [{"generated": 0, "accuracy": 0.2}, {"generated": 480, "accuracy": area}]
    return {"phase": "pilot", "arm": arm, "lr": lr, "seed": seed, "curve": curve, "wall_s": 10.0,
            "metrics": {"area": area, "accuracy_at_budget": area}}


def test_pilot_summary_shows_a_partial_pilot(bench):
    module = bench("paired_comparison")
    runs = [_pilot_run("grpo", 1e-5, 101, 0.5), _pilot_run("grpo", 1e-5, 100, 0.3), _pilot_run("flash_sync", 1e-6, 100, 0.4)]
    out = module.pilot_summary(runs)
    assert out["grpo"]["1e-05"] == {"seeds": [100, 101], "area": [0.3, 0.5], "area_mean": pytest.approx(0.4),
                                    "complete": True}
    assert out["flash_sync"]["1e-06"]["complete"] is False and set(out) == {"grpo", "flash_sync"}


def test_report_only_writes_the_logged_runs_and_runs_nothing(bench, tmp_path, monkeypatch):
    module = bench("paired_comparison")
    out = tmp_path / "pc.json"
    monkeypatch.setattr(module, "run_updates", lambda *a, **k: pytest.fail("--report-only ran a run"))
    monkeypatch.setattr(module, "connect_ray", lambda: pytest.fail("--report-only started Ray"))
    task = module.TASKS["sums"]
    scale = module.dataclasses.replace(module.FULL, eval_every=task.eval_every, eval_episodes=task.held_out)
    log = module.RunLog(out, key_fields=("phase", "arm", "lr", "seed"),
                        settings={"task": "sums", "scale": scale, "budget": task.budget}, resume=False)
    log.add(_pilot_run("flash_sync", 3e-6, 100, 0.46))
    report = module.main(["--task", "sums", "--phase", "pilot", "--report-only", "--output", str(out),
                          "--figure", str(tmp_path / "pc.png")])
    assert [r["seed"] for r in report["runs"]] == [100] and report["pilots"]["flash_sync"]["3e-06"]["complete"] is False
    assert json.loads(out.read_text())["runs"][0]["metrics"]["area"] == 0.46
    counted = module.main(["--task", "sums", "--report-only", "--output", str(out), "--figure", str(tmp_path / "c.png")])
    assert "found 0" in counted["learning_rate_choice"]["grpo"]["pilot_incomplete"]
    with pytest.raises(SystemExit):
        module.main(["--task", "sums", "--report-only", "--discard-log", "--output", str(out)])


def _counted_run(arm, seed, area):
    curve = [{"generated": 0, "accuracy": 0.2}, {"generated": 320, "accuracy": area}]
    metrics = {"area": area, "accuracy_at_budget": area, "initial_accuracy": 0.2, "wall_s": 100.0 + seed}
    return {"phase": "counted", "arm": arm, "lr": None, "seed": seed, "curve": curve, "wall_s": 100.0 + seed,
            "metrics": metrics}


def test_a_report_short_of_its_registered_seeds_is_sealed_until_final(bench, tmp_path, monkeypatch):
    """The stopping rule: no difference, no per-arm mean and no figure before every arm has every seed."""
    module = bench("paired_comparison")
    out, fig = tmp_path / "tool.json", tmp_path / "tool.png"
    task = module.TASKS["tool"]
    scale = module.dataclasses.replace(module.FULL, eval_every=task.eval_every, eval_episodes=task.held_out)
    log = module.RunLog(out, key_fields=("phase", "arm", "lr", "seed"),
                        settings={"task": "tool", "scale": scale, "budget": task.budget}, resume=False)
    for arm, seed, area in (("flash_async", 0, 0.5), ("grpo", 0, 0.4), ("flash_async", 1, 0.6)):
        log.add(_counted_run(arm, seed, area))
    args = ["--task", "tool", "--report-only", "--output", str(out), "--figure", str(fig)]
    sealed = module.main(args)
    assert sealed["comparisons"] is None and not fig.exists()
    assert sealed["seal"] == {"sealed": True, "missing_seeds": {"flash_async": [2], "grpo": [1, 2]},
                              "unsealed_early": False}
    assert sealed["arms"]["flash_async"] == {"n": 2, "wall_s": 100.5}  # no metric mean
    assert len(json.loads(out.read_text())["runs"]) == 3  # the runs stay: a later sitting resumes from them
    early = module.main([*args, "--final"])
    assert early["seal"]["unsealed_early"] is True and early["seal"]["sealed"] is False and fig.exists()
    assert early["comparisons"]["flash_async - grpo"]["area_differences"] == pytest.approx([0.1])
    assert early["arms"]["flash_async"]["area"] == pytest.approx(0.55)
    for arm, seed, area in (("grpo", 1, 0.5), ("flash_async", 2, 0.7), ("grpo", 2, 0.5)):
        log.add(_counted_run(arm, seed, area))
    recorded = json.loads(out.read_text())
    recorded["configs"] = {"grpo": {"lr": 3e-6}}  # as a call that ran grpo recorded it
    out.write_text(json.dumps(recorded))
    complete = module.main(args)
    assert complete["seal"] == {"sealed": False, "missing_seeds": {"flash_async": [], "grpo": []},
                                "unsealed_early": False}
    assert complete["configs"] == {"grpo": {"lr": 3e-6}}  # a report written from the log keeps the configs
    assert complete["comparisons"]["flash_async - grpo"]["area_differences"] == pytest.approx([0.1, 0.1, 0.2])


def test_arm_summary_reports_every_registered_secondary(bench):
    """Means over an arm's seeds; the largest drift of any run; rollouts to the target over the runs that reached it."""
    module = bench("paired_comparison")
    task = module.TASKS["sums"]
    runs = [{"arm": "grpo", "seed": seed, "metrics": {
        "area": area, "accepted_fraction_mean": accepted, "drift_mean": drift, "drift_max": 10 * drift,
        "generated_to_target": to_target, "wall_s": 100.0}}
        for seed, area, accepted, drift, to_target in ((0, 0.5, 1.0, 0.01, 160.0), (1, 0.7, 0.5, 0.03, None),
                                                       (2, 0.6, 0.75, 0.02, 80.0))]
    grpo = module.arm_summary(runs, task)["grpo"]
    assert grpo["n"] == 3 and grpo["area"] == pytest.approx(0.6)
    assert grpo["accepted_fraction_mean"] == pytest.approx(0.75) and grpo["drift_mean"] == pytest.approx(0.02)
    assert grpo["drift_max"] == pytest.approx(0.3)
    assert (grpo["reached_target"], grpo["generated_to_target_mean"]) == (2, 120.0)
    assert module.arm_summary([], task)["grpo"] == {
        "n": 0, **dict.fromkeys(("area", "accuracy_at_budget", "initial_accuracy", "tool_calls_initial",
                                 "tool_calls_final", "turns_final", "trained_over_generated", "policy_lag_mean",
                                 "accepted_fraction_mean", "drift_mean", "wall_s", "iteration_s_mean",
                                 "drift_max", "generated_to_target_mean")), "reached_target": 0}


def test_tool_task_dtype_reaches_the_learner_and_only_the_tool_task_takes_it(bench):
    module = bench("paired_comparison")
    task = module.TASKS["tool"]
    shipped = module.make_config("tool", module.FULL, task, model_path="m", arm="grpo", lr=None, seed=0)
    assert shipped.dtype == "bfloat16"  # the job's own
    config = module.make_config("tool", module.FULL, task, model_path="m", arm="grpo", lr=None, seed=0,
                                dtype="float32")
    assert config.dtype == "float32" and config.prompts_per_batch == 4 and config.evaluation_num_episodes == 64
    with pytest.raises(SystemExit):
        module.parse_args(["--task", "sums", "--dtype", "float32"])


def test_tool_report_means_and_plots_tool_calls_and_turns_over_training(bench, monkeypatch):
    """Part 2 records held-out success, tool calls and turns per episode over training: a panel each."""
    module = bench("paired_comparison")
    task = module.TASKS["tool"]
    runs = []
    for arm, calls, turns in (("flash_async", (1.0, 2.0), (2.0, 3.0)), ("grpo", (1.0, 0.5), (2.0, 1.5))):
        curve = [{"generated": g, "accuracy": 0.3, "tool_calls_mean": c, "turns_mean": t}
                 for g, c, t in zip((0, 320), calls, turns, strict=True)]
        run = {"arm": arm, "seed": 0, "curve": curve, "wall_s": 1.0}
        run["metrics"] = {"tool_calls_final": calls[-1], "turns_final": turns[-1], "wall_s": 1.0}
        runs.append(run)
    arms = module.arm_summary(runs, task)
    assert arms["grpo"]["tool_calls_final"] == 0.5 and arms["grpo"]["turns_final"] == 1.5
    assert arms["flash_async"]["turns_final"] == 3.0
    saved = {}
    monkeypatch.setattr(module, "_save", lambda plt, fig, path, title: saved.setdefault("fig", fig) and path)
    module.plot(runs, task, "unused.png", title="t")
    axes = saved["fig"].axes
    assert [ax.get_ylabel() for ax in axes] == ["held-out success", "tool calls per held-out episode",
                                                "model turns per held-out episode"]
    grpo_calls = [line for line in axes[1].lines if line.get_label() == "grpo (mean of 1)"]
    assert grpo_calls[0].get_ydata()[0] == 1.0 and grpo_calls[0].get_ydata()[-1] == 0.5  # interpolated to 320
    assert grpo_calls[0].get_ydata()[30] == pytest.approx(0.75)


def test_sums_figure_draws_each_arms_mean_over_runs_evaluated_at_different_counts(bench, monkeypatch):
    """The asynchronous arm evaluates at its own generated counts: its mean is taken on a common grid."""
    module = bench("paired_comparison")
    task = module.TASKS["sums"]
    runs = [{"arm": "flash_async", "seed": seed, "curve": [{"generated": g, "accuracy": a} for g, a in points]}
            for seed, points in ((0, ((0, 0.3), (480, 0.7))), (1, ((0, 0.3), (240, 0.5), (500, 0.8))))]
    saved = {}
    monkeypatch.setattr(module, "_save", lambda plt, fig, path, title: saved.setdefault("fig", fig) and path)
    module.plot(runs, task, "unused.png", title="t")
    (ax,) = saved["fig"].axes
    assert ax.get_ylabel() == "held-out accuracy"
    (mean,) = [line for line in ax.lines if line.get_label() == "flash_async (mean of 2)"]
    assert list(mean.get_xdata()[[0, 30, 60]]) == [0.0, 240.0, 480.0]
    assert mean.get_ydata()[30] == pytest.approx((0.5 + 0.5) / 2)
    assert mean.get_ydata()[60] == pytest.approx((0.7 + 0.5 + 0.3 * 240 / 260) / 2)
