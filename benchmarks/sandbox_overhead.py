"""Per-call overhead of the code sandbox, against a bare interpreter start in the same run.

Every call starts a fresh process, so the cost that matters is the start: this measures the wall time
of running a trivial program (``pass``) and a small computation through each sandbox backend that
works here, next to ``python -I -c ...`` started with ``subprocess`` (the baseline) and
``python -I -S`` (how the launcher starts the interpreter). Rows are
interleaved round-robin so machine noise hits all of them alike; the table shows median and p90
milliseconds, the median overhead over the baseline, and the ratio to it.

    python benchmarks/sandbox_overhead.py                 # 30 calls per row
    python benchmarks/sandbox_overhead.py --calls 100 --output /tmp/sandbox.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

from flashrl.envs.sandbox import Sandbox, SandboxConfig, available_backends

PROGRAMS = {
    "pass": "pass",
    "compute": "import math\nprint(sum(math.comb(40, k) for k in range(41)))",
}


def _bare(code: str, *flags: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, *flags, "-c", code], stdin=subprocess.DEVNULL, capture_output=True, check=True)
    return time.perf_counter() - start


def _sandboxed(sandbox: Sandbox, code: str) -> float:
    start = time.perf_counter()
    result = sandbox.run(code)
    elapsed = time.perf_counter() - start
    if result.exit_code != 0:
        raise RuntimeError(f"{sandbox.backend} failed on {code!r}: {result.stderr[-500:]}")
    return elapsed


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--calls", type=int, default=30, help="calls per row (after one warm-up call)")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/sandbox_overhead.json"))
    args = parser.parse_args()

    runners = {
        "baseline (python -I)": lambda code: _bare(code, "-I"),
        # The launcher starts the interpreter with -S (no site .pth processing) and sets the module
        # path itself: this row shows what that alone saves.
        "bare python -I -S": lambda code: _bare(code, "-I", "-S"),
    }
    for backend in available_backends():
        sandbox = Sandbox(SandboxConfig(backend=backend))
        runners[backend] = lambda code, s=sandbox: _sandboxed(s, code)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        unconfined = Sandbox(SandboxConfig(backend="unconfined", allow_unconfined=True))
    runners["launcher only (unconfined)"] = lambda code: _sandboxed(unconfined, code)

    times: dict[str, dict[str, list[float]]] = {p: {r: [] for r in runners} for p in PROGRAMS}
    for program, code in PROGRAMS.items():
        for run in runners.values():
            run(code)  # warm-up: page cache, probe
        for _ in range(args.calls):
            for name, run in runners.items():
                times[program][name].append(run(code))

    rows = []
    for program in PROGRAMS:
        base = statistics.median(times[program]["baseline (python -I)"])
        for name, values in times[program].items():
            median = statistics.median(values)
            rows.append({
                "program": program, "runner": name, "calls": len(values),
                "median_ms": 1e3 * median, "p90_ms": 1e3 * _percentile(values, 0.9),
                "overhead_ms": 1e3 * (median - base), "ratio_to_baseline": median / base,
            })

    print(f"{'program':<9} {'runner':<28} {'median ms':>10} {'p90 ms':>8} {'overhead ms':>12} {'ratio':>6}")
    for r in rows:
        print(f"{r['program']:<9} {r['runner']:<28} {r['median_ms']:>10.1f} {r['p90_ms']:>8.1f} "
              f"{r['overhead_ms']:>12.1f} {r['ratio_to_baseline']:>6.2f}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({
        "benchmark": "sandbox_overhead", "python": sys.version.split()[0], "machine": platform.machine(),
        "kernel": platform.release(), "calls": args.calls, "rows": rows,
    }, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
