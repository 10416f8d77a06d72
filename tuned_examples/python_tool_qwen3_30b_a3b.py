"""FlashREINFORCE: Qwen3-30B-A3B (MoE), 20-turn Python-tool trust ablation (`qwen3_tool_ablation`).

    python tuned_examples/python_tool_qwen3_30b_a3b.py --dry-run
    python tuned_examples/python_tool_qwen3_30b_a3b.py --resume                # continue the newest run from its newest checkpoint
    python tuned_examples/python_tool_qwen3_30b_a3b.py --print-config --variant no_trust
    python tuned_examples/python_tool_qwen3_30b_a3b.py --data data/dapo/train.jsonl \\
        --eval-data data/eval/amc23_minerva_aime25.jsonl

Every value comes from `examples/settings/qwen3_tool_ablation.json` (merged over
`examples/settings/common.json`) of the public reference `yifanzhang-pro/FlashREINFORCE`, held in
`flashrl/reproduction/experiments.py`; the hardware layout is flashrl's choice. Variants by the reference's
names: no_trust, no_is.

See tuned_examples/README.md for the table of values and their sources.
"""

import sys

from flashrl.reproduction.experiment_run import run_experiment

if __name__ == "__main__":
    sys.exit(run_experiment("qwen3_tool_ablation"))
