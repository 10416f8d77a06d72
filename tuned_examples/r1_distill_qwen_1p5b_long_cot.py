"""FlashREINFORCE: DeepSeek-R1-Distill-Qwen-1.5B, long chain-of-thought math: reference experiment `r1`.

    python tuned_examples/r1_distill_qwen_1p5b_long_cot.py --dry-run
    python tuned_examples/r1_distill_qwen_1p5b_long_cot.py --resume                # continue the newest run from its newest checkpoint
    python tuned_examples/r1_distill_qwen_1p5b_long_cot.py --print-config --variant gate_5e3
    python tuned_examples/r1_distill_qwen_1p5b_long_cot.py --data data/sanity-r1d/train.jsonl \\
        --eval-data data/aime24_25.jsonl

Every value comes from `examples/settings/deepseek_r1_distill_qwen_1p5b_math_sanity.json` (merged
over `examples/settings/common.json`) of the public reference `yifanzhang-pro/FlashREINFORCE`, held
in `flashrl/reproduction/experiments.py`; the hardware layout is flashrl's choice. Variants by the
reference's names: gate_5e3, no_trust.

See tuned_examples/README.md for the table of values and their sources.
"""

import sys

from flashrl.reproduction.experiment_run import run_experiment

if __name__ == "__main__":
    sys.exit(run_experiment("r1"))
