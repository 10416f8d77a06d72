"""FlashREINFORCE: Qwen2.5-Math-1.5B on DAPO math problems (the reference experiment `qwen_math`).

    python tuned_examples/qwen25_math_1p5b.py --dry-run
    python tuned_examples/qwen25_math_1p5b.py --resume                # continue the newest run from its newest checkpoint
    python tuned_examples/qwen25_math_1p5b.py --print-config --variant gate_1e3
    python tuned_examples/qwen25_math_1p5b.py --data data/dapo/train.jsonl \\
        --eval-data data/eval/amc23_minerva_aime25.jsonl

Every value comes from `examples/settings/qwen2p5_math_1p5b_dapo_math.json` (merged over
`examples/settings/common.json`) of the public reference `yifanzhang-pro/FlashREINFORCE`, held in
`flashrl/reproduction/experiments.py`; the hardware layout is flashrl's choice. Variants by the reference's
names: gate_1e3, negative_q09, negative_q02, five_benchmark_eval16.

See tuned_examples/README.md for the table of values and their sources.
"""

import sys

from flashrl.reproduction.experiment_run import config_factory, experiment_preset, run_experiment

# the Tune sweep (tune_delta_batch_sweep.py) builds its GPU grid on these
PRESET = experiment_preset("qwen_math")
make_config = config_factory("qwen_math")

if __name__ == "__main__":
    sys.exit(run_experiment("qwen_math"))
