"""Benchmark reports as TensorBoard runs: held-out accuracy and the learner's metrics against rollouts.

The training benchmarks (`learning_efficiency.py`, `ablations.py`) write their TensorBoard runs
themselves; this rebuilds them from any committed report, so the curves behind the tables and PNGs
can be browsed without rerunning anything:

    python benchmarks/tensorboard_export.py benchmarks/results/learning_efficiency.json \\
        benchmarks/results/ablations.json
    tensorboard --logdir runs/benchmarks

Each (method or arm, seed) becomes `runs/benchmarks/<benchmark>/<name>/seed<k>`; the step is the
number of rollouts trained on, so FlashREINFORCE and GRPO line up at equal rollout budgets.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _tensorboard import write_tensorboard

DEFAULT_LOGDIR = Path("runs") / "benchmarks"


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("reports", nargs="+", help="benchmark JSON reports with a 'runs' list")
    parser.add_argument("--logdir", default=str(DEFAULT_LOGDIR))
    args = parser.parse_args(argv)
    folders: list[str] = []
    for path in args.reports:
        report = json.loads(Path(path).read_text(encoding="utf-8"))
        if not isinstance(report.get("runs"), list) or "benchmark" not in report:
            raise SystemExit(f"{path}: expected a training benchmark report (keys 'benchmark' and 'runs')")
        folders += write_tensorboard(report, args.logdir)
    print(f"wrote {len(folders)} TensorBoard runs; view them with: tensorboard --logdir {args.logdir}")
    return folders


if __name__ == "__main__":
    main()
