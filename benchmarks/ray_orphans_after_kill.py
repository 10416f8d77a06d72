"""What a local Ray cluster leaves behind when its driver is killed with SIGKILL, and for how long.

A flashrl run without ``RAY_ADDRESS`` starts a local cluster from its own process (``ray.init()`` in
``flashrl.ray_utils.init_or_join``): the GCS server, the raylet, the dashboard agent, the runtime-env
agent, the log monitor, then the workers. A SIGKILL gives the driver no chance to stop them. This
script starts such a driver, kills it (only its process, as the kernel's OOM killer or ``kill -9 PID``
does; or its whole process group, as a terminal's job control does), and polls every second which of
the cluster's processes (the driver's descendants, listed before the kill) are still alive.

    python benchmarks/ray_orphans_after_kill.py    # writes benchmarks/results/ray_orphans_after_kill.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _reports import write_json

DRIVER = """
import time
from flashrl.ray_utils import init_or_join
init_or_join()
import ray
print(ray._private.worker._global_node.get_session_dir_path(), flush=True)
time.sleep(3600)
"""

NAMES = {  # a command-line fragment -> the process's name in the results
    "gcs_server": "gcs_server",
    "raylet": "raylet",
    "dashboard/agent.py": "dashboard_agent",
    "runtime_env/agent/main.py": "runtime_env_agent",
    "log_monitor.py": "log_monitor",
    "monitor.py": "monitor",
    "default_worker.py": "worker",
}


def _name(cmdline: str) -> str:
    """A process's name in the results: the Ray component its command line runs (never a path)."""
    for fragment, name in NAMES.items():
        if fragment in cmdline:
            return name
    return os.path.basename(cmdline.split(" ")[0]) or "unknown"


def cluster_processes(root: int) -> dict[int, str]:
    """pid -> name of ``root``'s descendants: the local cluster it started (the agents are the raylet's)."""
    import psutil

    try:
        children = psutil.Process(root).children(recursive=True)
    except psutil.NoSuchProcess:
        return {}
    found = {}
    for proc in children:
        try:
            found[proc.pid] = _name(" ".join(proc.cmdline()))
        except psutil.NoSuchProcess:
            continue
    return found


def alive(pids: dict[int, str]) -> dict[int, str]:
    """The processes of ``pids`` still running (a zombie counts as gone)."""
    import psutil

    running = {}
    for pid, name in pids.items():
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                running[pid] = name
        except psutil.NoSuchProcess:
            continue
    return running


def kill_and_watch(whole_group: bool, limit_s: float) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], env=env, stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    driver.stdout.readline()  # the cluster is up
    time.sleep(10)  # its agents too
    started = cluster_processes(driver.pid)
    if whole_group:
        os.killpg(driver.pid, signal.SIGKILL)
    else:
        driver.kill()
    driver.wait()
    killed_at = time.monotonic()
    gone: dict[str, float | None] = {}
    while time.monotonic() - killed_at < limit_s:
        now = alive(started)
        for pid, name in started.items():
            if pid not in now:
                gone.setdefault(f"{name}:{pid}", round(time.monotonic() - killed_at, 1))
        if not now:
            break
        time.sleep(1.0)
    left = alive(started)
    for pid, name in started.items():
        gone.setdefault(f"{name}:{pid}", None)  # None: still alive at the limit
    for pid in left:  # the measurement's own cleanup, not a recommendation
        os.kill(pid, signal.SIGKILL)
    return {"killed": "process group" if whole_group else "driver process", "seconds_until_gone": gone,
            "alive_at_limit": sorted(left.values()), "limit_s": limit_s}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--limit-s", type=float, default=300.0, help="stop watching after this many seconds")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/ray_orphans_after_kill.json"))
    args = parser.parse_args(argv)
    import ray

    result = {
        "benchmark": "ray_orphans_after_kill",
        "runs": [kill_and_watch(False, args.limit_s), kill_and_watch(True, args.limit_s)],
        "machine": {"platform": platform.platform(), "ray": ray.__version__, "cpus": os.cpu_count()},
    }
    print(json.dumps(result, indent=2))
    write_json(args.output, result)
    return result


if __name__ == "__main__":
    main()
