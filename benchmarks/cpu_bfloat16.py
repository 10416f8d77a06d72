"""bfloat16 vs float32 matmuls on this CPU: why a bfloat16 learner may be slow here.

One linear layer's forward and backward at SmolLM2-135M's MLP shapes (2048 tokens x 576 -> 1536, the
CPU jobs' 2048-token passes), in float32 and in bfloat16, best of a few repeats each, in the same run;
the ratio is what matters (flashrl.learners.cpu_bfloat16 warns when the CPU lacks native bfloat16).

    python benchmarks/cpu_bfloat16.py      # seconds; writes benchmarks/results/cpu_bfloat16.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _repo import RESULTS
from _reports import machine, table, write_json

from flashrl.learners.cpu_bfloat16 import native_bfloat16

SHAPES = {"tokens": 2048, "in": 576, "out": 1536}


def seconds(dtype: torch.dtype, repeats: int) -> float:
    """Best wall time of a linear layer's forward and backward in ``dtype``."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SHAPES["tokens"], SHAPES["in"], generator=generator).to(dtype).requires_grad_()
    w = torch.randn(SHAPES["out"], SHAPES["in"], generator=generator).to(dtype).requires_grad_()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.nn.functional.linear(x, w).float().sum().backward()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", default=str(RESULTS / "cpu_bfloat16.json"))
    args = parser.parse_args(argv)
    rows = [{"dtype": name, "seconds": seconds(dtype, args.repeats)}
            for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16))]
    ratio = rows[1]["seconds"] / rows[0]["seconds"]
    report = {"benchmark": "cpu_bfloat16", "shapes": SHAPES, "repeats": args.repeats, "rows": rows,
              "bfloat16_over_float32": ratio, "native_bfloat16": native_bfloat16(),
              "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "machine": machine()}
    print(table(["dtype", "seconds"], [[r["dtype"], f"{r['seconds']:.4f}"] for r in rows]))
    print(f"bfloat16 / float32: {ratio:.1f}x (native bfloat16: {native_bfloat16()})")
    print(f"wrote {write_json(args.output, report)}")
    return report


if __name__ == "__main__":
    main()
