"""The resolved configs users see stay byte-identical: every experiment's `--print-config` (each variant)
and every tuned example's `FlashReinforceConfig.to_dict()` (the flat names Tune and checkpoints use).

The expected texts were recorded from the code before the config was composed of the core's specs
(`tests/reproduction/data/config_outputs.json`). A change that alters any of them on purpose records them
again: `python tests/reproduction/test_config_outputs_unchanged.py --record` (and says why in its commit).
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import pytest

RECORD = Path(__file__).parent / "data" / "config_outputs.json"
CPU_EXAMPLES = ("smollm2_arithmetic_cpu",)


def _print_config(name: str, variant: str | None) -> str:
    from flashrl.reproduction.experiment_run import run_experiment

    argv = ["--print-config"] + (["--variant", variant] if variant else [])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert run_experiment(name, argv) == 0
    return out.getvalue()


def _example_dict(script: str) -> str:
    """`to_dict()` of a tuned example's config as its command line builds it with no flags."""
    import importlib.util

    from flashrl.recipes.run import build_config

    path = Path(__file__).resolve().parents[2] / "tuned_examples" / f"{script}.py"
    spec = importlib.util.spec_from_file_location(f"_example_{script}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config, _ = build_config(module.PRESET, module.make_config, ["--output", "results/x"])
    return json.dumps(config.to_dict(), indent=1, sort_keys=True, default=repr)


def _cases() -> list[str]:
    from flashrl.reproduction.experiments import EXPERIMENTS

    cases = []
    for name, experiment in EXPERIMENTS.items():
        cases += [f"print-config {name}"] + [f"print-config {name} {v}" for v in experiment.variants]
        cases.append(f"to_dict {name}")
    return cases + [f"to_dict_example {script}" for script in CPU_EXAMPLES]


def _output(case: str) -> str:
    kind, name, *variant = case.split()
    if kind == "print-config":
        return _print_config(name, variant[0] if variant else None)
    if kind == "to_dict":
        from flashrl.recipes.run import build_config
        from flashrl.reproduction.experiment_run import (
            add_experiment_arguments,
            config_factory,
            experiment_preset,
        )

        config, _ = build_config(experiment_preset(name, ()), config_factory(name), ["--output", "results/x"],
                                 add_arguments=lambda parser: add_experiment_arguments(parser, name))
        return json.dumps(config.to_dict(), indent=1, sort_keys=True, default=repr)
    return _example_dict(name)


def _recorded() -> dict[str, str]:
    return json.loads(RECORD.read_text(encoding="utf-8"))


def test_every_case_is_recorded():
    assert sorted(_recorded()) == sorted(_cases())


@pytest.mark.parametrize("case", sorted(_recorded()) if RECORD.exists() else [])
def test_output_is_byte_identical_to_the_record(case, monkeypatch):
    # The ALFWorld experiment reads $ALFWORLD_DATA for its default data folder, and importing the
    # alfworld package sets it: the record is of a shell without it.
    monkeypatch.delenv("ALFWORLD_DATA", raising=False)
    assert _output(case) == _recorded()[case]


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        raise SystemExit("usage: python tests/reproduction/test_config_outputs_unchanged.py --record")
    RECORD.parent.mkdir(parents=True, exist_ok=True)
    RECORD.write_text(json.dumps({case: _output(case) for case in _cases()}, indent=1, sort_keys=True) + "\n",
                      encoding="utf-8")
    print(f"recorded {len(_cases())} outputs in {RECORD}")
