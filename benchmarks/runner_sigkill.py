"""The CPU agentic job with its EnvRunner killed by SIGKILL mid-run: does the run finish, and do its evaluations go on?

Starts `tuned_examples/smollm2_python_tool_cpu.py` (the README's agentic main job, unchanged but for
``--stop-iters``), waits until ``progress.jsonl`` holds ``--kill-after`` iterations, then sends SIGKILL
to the EnvRunner actor's process (``ray::EnvRunner``, found by its title; the vLLM engine process under
it dies with it), as the kernel's OOM killer does. The job must replace the runner and go on: this
script records the job's exit code, every iteration's row (updates, lost episodes, restarts, held-out
evaluations) and the console.

    python benchmarks/runner_sigkill.py --dtype float32    # ~30 minutes on 2 cores (12 updates, 3 evaluations)
    # writes benchmarks/results/runner_sigkill.json and runner_sigkill.log (the run folder written <run folder>)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _repo import RESULTS
from _reports import machine, write_json

JOB = Path("tuned_examples") / "smollm2_python_tool_cpu.py"
"""Run from the repository root, as every benchmark."""
KEYS = ("training_iteration", "num_env_steps_trained_lifetime", "evaluation/episode_return_mean",
        "env_runners/num_lost_episodes_lifetime", "env_runners/num_restarts_lifetime", "time_total_s")


def runner_pids(root: int) -> list[int]:
    """Descendants of ``root`` whose title is a flashrl EnvRunner actor's (``ray::EnvRunner[.<method>]``).

    The job starts its own local Ray cluster, whose workers descend from the job's process; another
    run's runners on the same machine are not touched."""
    out = subprocess.run(["ps", "-eo", "pid=,ppid=,args="], capture_output=True, text=True, check=True).stdout
    parent, title = {}, {}
    for line in out.splitlines():
        pid, ppid, *rest = line.split(None, 2)
        parent[int(pid)], title[int(pid)] = int(ppid), rest[0] if rest else ""

    def descends(pid: int) -> bool:
        while pid > 1:
            pid = parent.get(pid, 0)
            if pid == root:
                return True
        return False

    return [pid for pid, name in title.items() if name.startswith("ray::EnvRunner") and descends(pid)]


def rows(progress: Path) -> list[dict]:
    if not progress.exists():
        return []
    out = []
    for line in progress.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line being written
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--stop-iters", type=int, default=12)
    parser.add_argument("--kill-after", type=int, default=3, help="training iterations done before the kill")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="the learner's dtype (default: the job's, bfloat16; float32 on a CPU without native "
                        "bfloat16, where a bfloat16 update takes many minutes)")
    parser.add_argument("--output", default=str(RESULTS / "runner_sigkill.json"))
    args = parser.parse_args(argv)
    log_path = Path(args.output).with_suffix(".log")
    with tempfile.TemporaryDirectory(prefix="flashrl-sigkill-") as tmp:
        out_dir = Path(tmp) / "run"
        command = [sys.executable, str(JOB), "--stop-iters", str(args.stop_iters), "--output", str(out_dir),
                   *(["--dtype", args.dtype] if args.dtype else [])]
        start = time.time()
        with open(log_path, "w") as log:
            job = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
            progress = next(iter(out_dir.rglob("progress.jsonl")), None) if out_dir.exists() else None
            killed: dict = {}
            while job.poll() is None:
                time.sleep(5)
                progress = progress or (next(iter(out_dir.rglob("progress.jsonl")), None) if out_dir.exists() else None)
                done = sum(row.get("training_iteration", 0) >= 1 for row in rows(progress)) if progress else 0
                if not killed and done >= args.kill_after:
                    pids = runner_pids(job.pid)
                    if len(pids) != 1:
                        raise RuntimeError(f"expected one EnvRunner process, found {pids}")
                    os.kill(pids[0], signal.SIGKILL)
                    killed = {"pid": pids[0], "after_iterations": done, "at_s": round(time.time() - start, 1)}
                    print(f"SIGKILL to EnvRunner pid {pids[0]} after {done} iterations", flush=True)
        history = rows(progress) if progress else []
        result_file = next(iter(out_dir.rglob("result.json")), None)
        result = {
            "benchmark": "runner_sigkill",
            "command": [Path(c).name if c == sys.executable else c for c in command[1:]],
            "exit_code": job.returncode,
            "killed": killed,
            "wall_s": round(time.time() - start, 1),
            "iterations": [{k: row.get(k) for k in KEYS if k in row} for row in history],
            "result": json.loads(result_file.read_text()) if result_file else None,
            "machine": machine(),
        }
    print(json.dumps({k: result[k] for k in ("exit_code", "killed", "wall_s")}))
    write_json(args.output, json.loads(json.dumps(result).replace(str(out_dir), "<run folder>")))
    log_path.write_text(log_path.read_text().replace(str(out_dir), "<run folder>"))
    return result


if __name__ == "__main__":
    main()
