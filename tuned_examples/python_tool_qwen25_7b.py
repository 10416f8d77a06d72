"""FlashREINFORCE: Qwen2.5-7B-Instruct, 10-turn math with a Python tool (reference experiment `qwen7b_tool`).

    python tuned_examples/python_tool_qwen25_7b.py --dry-run
    python tuned_examples/python_tool_qwen25_7b.py --resume                # continue the newest run from its newest checkpoint
    python tuned_examples/python_tool_qwen25_7b.py --print-config --variant negative_q09
    python tuned_examples/python_tool_qwen25_7b.py --data data/dapo/train.jsonl \\
        --eval-data data/eval/amc23_minerva_aime25.jsonl

Every value comes from `examples/settings/qwen2p5_7b_instruct_python_tool_10turn.json` (merged over
`examples/settings/common.json`) of the public reference `yifanzhang-pro/FlashREINFORCE`, held in
`flashrl/reproduction/experiments.py`; the hardware layout is flashrl's choice. Variants by the reference's
names: negative_q09, negative_q02, negative_q00, token_mean, constant_length, grpo.

See tuned_examples/README.md for the table of values and their sources.
"""

import sys

from flashrl.reproduction.experiment_run import run_experiment

if __name__ == "__main__":
    sys.exit(run_experiment("qwen7b_tool"))
