"""scripts/train_molt.py: the experiments as Molt 0.2.1 commands; no Molt installation needed."""

from __future__ import annotations

import importlib.util
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from flashrl.reproduction.experiments import EXPERIMENTS, resolve_experiment
from flashrl.reproduction.molt import MOLT_0_2_1_CHOICES, MOLT_0_2_1_FLAGS, extract_flags

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "train_molt.py"
SPEC = importlib.util.spec_from_file_location("train_molt", SCRIPT)
train_molt = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(train_molt)

CASES = [(name, variant) for name, s in EXPERIMENTS.items() for variant in (None, *s.variants)]
REFUSED = {  # what Molt 0.2.1 cannot run, and the reason's key word
    ("qwen_math", "negative_q09"): "q < 1",
    ("qwen_math", "negative_q02"): "q < 1",
    ("qwen7b_tool", "negative_q09"): "q < 1",
    ("qwen7b_tool", "negative_q02"): "q < 1",
    ("qwen7b_tool", "negative_q00"): "q < 1",
    ("qwen7b_tool", "constant_length"): "constant_length",
    ("qwen3_tool_ablation", "no_is"): "no_is",
    ("alfworld", None): "q < 1",  # the ALFWorld experiment itself uses q = 0.9
    ("alfworld", "negative_q02"): "q < 1",
    ("alfworld", "no_is"): "no_is",
    ("alfworld", "grpo"): "partial rollout",
}


def dry_run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = train_molt.main([*args, "--dry-run"])
    out, err = capsys.readouterr()
    return code, out, err


def command_of(out: str) -> list[str]:
    line = next(line for line in out.splitlines() if "molt.cli.train_rl_ray" in line)
    argv = shlex.split(line)
    return argv[argv.index("molt.cli.train_rl_ray") + 1 :]


def parse(argv: list[str]) -> dict[str, list[str]]:
    """Flag -> its values, checked against the recorded 0.2.1 list (kinds and choices)."""
    flags: dict[str, list[str]] = {}
    i = 0
    while i < len(argv):
        flag = argv[i]
        assert flag in MOLT_0_2_1_FLAGS, f"{flag} is not a Molt 0.2.1 flag"
        j = i + 1
        while j < len(argv) and not argv[j].startswith("--"):
            j += 1
        values = argv[i + 1 : j]
        kind = MOLT_0_2_1_FLAGS[flag]
        if kind == "values:+":
            assert len(values) >= 1, (flag, values)
        else:
            arity = (
                {"switch": 0, "value": 1}[kind] if kind in ("switch", "value") else int(kind.split(":")[1])
            )
            assert len(values) == arity, (flag, kind, values)
        for value in values:
            assert value in MOLT_0_2_1_CHOICES.get(flag, (value,)), (flag, value)
        assert flag not in flags, f"{flag} given twice"
        flags[flag] = values
        i = j
    return flags


def test_dry_run_with_no_argument_works_and_shows_the_placeholders(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = train_molt.main(["--dry-run"])
    out = capsys.readouterr().out
    assert code == 0
    assert "placeholders to replace: <TRAIN_DATA>, <EVAL_DATA>, <AGENT_PATH>" in out
    flags = parse(command_of(out))
    assert flags["--data.prompt_dataset"] == ["<TRAIN_DATA>"] and flags["--train.agent_path"] == [
        "<AGENT_PATH>"
    ]
    assert flags["--actor.model_name_or_path"] == ["deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"]
    assert "MAX_AGENT_TURNS=1 " in out


def test_clean_checkout_dry_run_needs_no_installed_package(tmp_path: Path) -> None:
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONNOUSERSITE": "1"}
    result = subprocess.run(
        [sys.executable, "-S", str(SCRIPT), "--dry-run"],
        cwd=tmp_path,
        check=False,
        env=env,
        capture_output=True,
        text=True,
    )  # -S: no site-packages, so no installed flashrl
    assert result.returncode == 0, result.stderr
    assert "--algo.advantage.estimator flash_reinforce" in result.stdout


@pytest.mark.parametrize(("name", "variant"), CASES)
def test_every_experiment_is_a_valid_molt_command_or_refused(
    name: str, variant: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = dry_run(capsys, "--recipe", name, *(["--variant", variant] if variant else []))
    if (name, variant) in REFUSED:
        assert code == 2 and "molt.cli.train_rl_ray" not in out
        assert f"Molt 0.2.1 cannot run setting {name}" in err and REFUSED[(name, variant)] in err
        assert "run it natively: python tuned_examples/" in err
        return
    assert code == 0, err
    flags = parse(command_of(out))  # every flag in the recorded 0.2.1 list, with the right arity
    r = resolve_experiment(name, [variant] if variant else [])
    assert flags["--train.max_epochs"] == ["1"] and "--train.force_on_policy" in flags
    assert flags["--train.batch_size"] == [str(r.flags["train.batch_size"])]
    assert flags["--rollout.max_new_tokens"] == [str(r.flags["rollout.max_new_tokens"])]
    assert flags["--algo.kl.init_coef"] == ["0"]
    if r.is_flash_reinforce:
        delta = float(r.flags["actor.flash_gate_delta"])
        assert flags["--algo.advantage.estimator"] == ["flash_reinforce"]
        assert flags["--algo.advantage.is_correction_level"] == ["seq"]
        assert flags["--algo.advantage.is_correction_gating"] == ["binary_kl"]
        assert flags["--algo.advantage.is_correction_mode"] == ["mask"]
        assert float(flags["--algo.advantage.is_correction_threshold"][0]) == delta
        assert flags["--rollout.n_samples_per_prompt"] == ["1"]
        assert "--actor.loss_mode" not in flags  # 0.2.1 has no flash_reinforce loss mode
        mode = "token-mean" if variant == "token_mean" else "seq-mean-token-mean"
        assert flags["--actor.loss_agg_mode"] == [mode]
    else:
        assert flags["--actor.loss_mode"] == ["ppo"] and flags["--algo.advantage.estimator"] == ["grpo"]
        assert flags["--algo.advantage.is_correction_level"] == ["off"]
        assert flags["--actor.eps_clip_low_high"] == ["0.2", "0.2"] and "--algo.advantage.no_whiten" in flags
        assert flags["--actor.loss_agg_mode"] == ["token-mean"]


def test_the_reference_launcher_flags_for_r1_with_gate_5e3(capsys: pytest.CaptureFixture[str]) -> None:
    # the reference's scripts/train_molt.py runs r1 at delta 5e-3: the experiment's gate_5e3 variant
    _, out, _ = dry_run(capsys, "--recipe", "r1", "--variant", "gate_5e3")
    text = " ".join(command_of(out))
    for expected in (
        "--train.force_on_policy",
        "--algo.advantage.estimator flash_reinforce",
        "--algo.advantage.is_correction_level seq",
        "--algo.advantage.is_correction_gating binary_kl",
        "--algo.advantage.is_correction_threshold 0.005",
        "--actor.loss_agg_mode seq-mean-token-mean",
        "--rollout.max_new_tokens 8192",
        "--data.max_len 9216",
        "--train.async_queue_size 8",
        "--rollout.vllm_generate_batch_size 512",
        "--eval.n_samples_per_prompt 32",
    ):
        assert expected in text


def test_delta_override_and_no_trust(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = dry_run(capsys, "--recipe", "qwen_math", "--delta", "inf")
    assert parse(command_of(out))["--algo.advantage.is_correction_threshold"] == ["inf"]
    with pytest.raises(SystemExit) as exit_:
        dry_run(capsys, "--recipe", "qwen7b_tool", "--variant", "grpo", "--delta", "0.01")
    assert exit_.value.code == 2 and "no trust region" in capsys.readouterr().err


def test_unknown_variant_and_abbreviated_flags_are_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        train_molt.main(["--recipe", "r1", "--variant", "typo", "--dry-run"])
    assert exit_.value.code == 2 and "gate_5e3" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_molt.main(["--rec", "r1", "--dry-run"])


def test_a_real_run_needs_the_data_and_the_agent(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        train_molt.main(["--recipe", "r1"])
    assert exit_.value.code == 2
    assert "--train-data, --eval-data, --agent-path" in capsys.readouterr().err


# ------------------------------------------------------------------------------ launch, with a fake Molt
def fake_molt(root: Path, version: str, help_flags: set[str]) -> Path:
    site = root / "site"
    cli = site / "molt" / "cli"
    cli.mkdir(parents=True)
    (site / "molt" / "__init__.py").write_text("")
    (cli / "__init__.py").write_text("")
    (cli / "train_rl_ray.py").write_text(
        "import os, sys\nfrom pathlib import Path\n"
        f"if '--help' in sys.argv: print({' '.join(sorted(help_flags))!r})\n"
        f"else: Path({str(root / 'started')!r}).write_text(os.environ['MAX_AGENT_TURNS'] + ' ' + ' '.join(sys.argv[1:]))\n"
    )
    info = site / f"molt_rl-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: molt-rl\nVersion: {version}\n")
    return site


@pytest.mark.parametrize(("version", "complete"), [("0.2.1", True), ("0.2.1", False), ("0.3.0", True)])
def test_launch_checks_version_and_help_before_starting(tmp_path: Path, version: str, complete: bool) -> None:
    help_flags = set(MOLT_0_2_1_FLAGS) - (set() if complete else {"--algo.advantage.is_correction_gating"})
    site = fake_molt(tmp_path, version, help_flags)
    data = tmp_path / "data"
    data.mkdir()
    agent = tmp_path / "agent.py"
    agent.write_text("")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    result = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--recipe",
            "qwen_math",
            "--train-data",
            str(data),
            "--eval-data",
            str(data),
            "--agent-path",
            str(agent),
            "--output",
            str(tmp_path / "out"),
        ],
        cwd=tmp_path,
        check=False,
        env=env,
        capture_output=True,
        text=True,
    )
    started = tmp_path / "started"
    if version == "0.2.1" and complete:
        assert result.returncode == 0, result.stderr
        turns, *argv = started.read_text().split(" ")
        assert turns == "1" and "--algo.advantage.is_correction_threshold" in argv
    else:
        assert result.returncode == 2 and not started.exists()
        expected = "expected version 0.2.1, found 0.3.0" if version != "0.2.1" else "is_correction_gating"
        assert expected in result.stderr


def test_flag_extraction_runs_only_the_parser_statements(tmp_path: Path) -> None:
    cli = tmp_path / "molt" / "cli"
    cli.mkdir(parents=True)
    (tmp_path / "molt" / "__init__.py").write_text("")
    (cli / "__init__.py").write_text("")
    (cli / "common_args.py").write_text("def add_x(parser):\n    parser.add_argument('--x.a', type=int)\n")
    (cli / "train_rl_ray.py").write_text(
        "import argparse\nimport ray_that_does_not_exist\n"
        "if __name__ == '__main__':\n"
        "    parser = argparse.ArgumentParser()\n"
        "    from molt.cli.common_args import add_x\n"
        "    add_x(parser)\n"
        "    parser.add_argument('--y.b', action='store_true')\n"
        "    parser.add_argument('--y.c', nargs=2, type=float)\n"
        "    parser.add_argument('--y.d', choices=['p', 'q'])\n"
        "    args = parser.parse_args()\n"
        "    raise SystemExit('the training part must not run')\n"
    )
    flags, choices = extract_flags(tmp_path)
    assert flags == {"--x.a": "value", "--y.b": "switch", "--y.c": "values:2", "--y.d": "value"}
    assert choices == {"--y.d": ("p", "q")}


def test_the_recorded_list_is_molt_0_2_1s() -> None:
    # spot checks against molt-rl 0.2.1's parser (molt/cli/train_rl_ray.py, molt/cli/common_args.py)
    assert len(MOLT_0_2_1_FLAGS) == 182
    assert MOLT_0_2_1_CHOICES["--actor.loss_mode"] == ("ppo", "cispo", "gspo")
    assert "flash_reinforce" in MOLT_0_2_1_CHOICES["--algo.advantage.estimator"]
    assert MOLT_0_2_1_FLAGS["--algo.advantage.is_correction_threshold"] == "values:+"
    assert MOLT_0_2_1_FLAGS["--train.force_on_policy"] == "switch"
    assert not any(flag.startswith("--actor.flash_") for flag in MOLT_0_2_1_FLAGS)
