"""FlashREINFORCE: Qwen2.5-7B-Instruct in ALFWorld, 50 turns (the reference experiment `alfworld`).

    python tuned_examples/alfworld_qwen25_7b.py --dry-run
    python tuned_examples/alfworld_qwen25_7b.py --resume                # continue the newest run from its newest checkpoint
    python tuned_examples/alfworld_qwen25_7b.py --print-config --variant negative_q02
    python tuned_examples/alfworld_qwen25_7b.py --alfworld-data $ALFWORLD_DATA/json_2.1.1

Every value comes from `examples/settings/qwen2p5_7b_instruct_alfworld_50turn.json` (merged over
`examples/settings/common.json`) of the public reference `yifanzhang-pro/FlashREINFORCE`, held in
`flashrl/reproduction/experiments.py`; the hardware layout is flashrl's choice. Variants by the reference's
names: negative_q02, no_is, grpo.

See tuned_examples/README.md for the table of values and their sources.
"""

import sys

from flashrl.reproduction.experiment_run import run_experiment

if __name__ == "__main__":
    sys.exit(run_experiment("alfworld"))
