"""Evidence-3's pinning: the sampler on one core, the learner on the other, set in each process and checked.

The pre-registration (benchmarks/paired_comparison.md, "Evidence-3", Pinning) pins the EnvRunner actor
and the vLLM engine it starts to CPU 0 and the learner to CPU 1, each process setting its own affinity,
and records what every process had at the start and at the end of the clock. Here:

* the runner sets its own affinity in Ray's ``worker_process_setup_hook`` (`pin_worker_from_env`), which
  runs in every worker process of the job before an actor is placed in it, so before the runner's
  constructor and long before it starts its engine; the engine's processes, started from it, inherit it,
  and vLLM's OpenMP threads bind to the same core (`runtime_env`'s ``VLLM_CPU_OMP_THREADS_BIND``);
* the learner is the job's local learner (``num_learners=0``): it lives in the algorithm's process, the
  benchmark's own, which pins itself (`pin_process`) before it builds the algorithm;
* `process_affinity` reads every thread's ``Cpus_allowed_list`` from ``/proc`` (``os.sched_setaffinity(0,
  ...)`` sets one thread's: a process is pinned only when all its threads are, which is why `pin_process`
  sets each one), and `pinning_problems` compares what was read with what was asked: a run with a
  problem is invalid (an infrastructure failure, re-run from scratch), never counted.

Linux only (``/proc``, ``sched_setaffinity``): elsewhere every check fails, so no run counts.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

RUNNER_CORES_ENV = "FLASHRL_BENCH_RUNNER_CORES"
"""Environment variable telling `pin_worker_from_env` which cores a Ray worker of this job takes."""


@dataclasses.dataclass(frozen=True)
class Pinning:
    """Which cores each side gets (the pre-registration's: runner {0}, learner {1})."""

    runner_cores: tuple[int, ...] = (0,)
    learner_cores: tuple[int, ...] = (1,)

    def __post_init__(self) -> None:
        if set(self.runner_cores) & set(self.learner_cores):
            raise ValueError(f"expected disjoint cores for the runner and the learner, got {self.runner_cores} "
                             f"and {self.learner_cores}")
        if not self.runner_cores or not self.learner_cores:
            raise ValueError(f"expected at least one core per side, got {self.runner_cores} / {self.learner_cores}")


def cores_text(cores: Iterable[int]) -> str:
    """``0-2,5``: the format of ``Cpus_allowed_list`` and of ``VLLM_CPU_OMP_THREADS_BIND``."""
    ordered = sorted(set(cores))
    if not ordered:
        return ""
    parts, start, previous = [], ordered[0], ordered[0]
    for core in [*ordered[1:], None]:
        if core is not None and core == previous + 1:
            previous = core
            continue
        parts.append(f"{start}-{previous}" if start != previous else f"{start}")
        if core is not None:
            start = previous = core
    return ",".join(parts)


def parse_cores(text: str) -> list[int]:
    """``Cpus_allowed_list`` (``0-2,5``) -> [0, 1, 2, 5]."""
    cores: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        cores.extend(range(int(low), int(high or low) + 1))
    return sorted(set(cores))


def runtime_env(pinning: Pinning) -> dict[str, Any]:
    """What the job's Ray ``runtime_env`` adds: the hook that pins every worker, and vLLM's OpenMP binding."""
    cores = cores_text(pinning.runner_cores)
    return {
        "worker_process_setup_hook": pin_worker_from_env,
        "env_vars": {RUNNER_CORES_ENV: cores, "VLLM_CPU_OMP_THREADS_BIND": cores, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
    }


def _thread_ids(pid: int | str = "self") -> list[int]:
    return sorted(int(tid) for tid in os.listdir(f"/proc/{pid}/task"))


def pin_process(cores: Sequence[int]) -> dict[int, list[int]]:
    """Pin every thread of this process to `cores` (``taskset -a``); returns each thread's affinity before.

    Threads started later inherit their creator's affinity, so after this the whole process stays on `cores`
    unless a thread sets its own (vLLM's OpenMP threads do, to the same cores).
    """
    before: dict[int, list[int]] = {}
    for tid in _thread_ids():
        try:
            before[tid] = sorted(os.sched_getaffinity(tid))
            os.sched_setaffinity(tid, set(cores))
        except (ProcessLookupError, FileNotFoundError):  # the thread ended meanwhile
            continue
    return before


def restore_process(before: Mapping[int, Sequence[int]]) -> None:
    """Give each thread `pin_process` pinned its earlier affinity back; threads born since get the main one's."""
    main = before.get(os.getpid())
    for tid in _thread_ids():
        cores = before.get(tid, main)
        if cores is None:
            continue
        try:
            os.sched_setaffinity(tid, set(cores))
        except (ProcessLookupError, FileNotFoundError):
            continue


def pin_worker_from_env() -> None:
    """Ray's ``worker_process_setup_hook``: pin this worker process to the cores `RUNNER_CORES_ENV` names."""
    text = os.environ.get(RUNNER_CORES_ENV)
    if text:
        pin_process(parse_cores(text))


def process_affinity(pid: int) -> dict[str, Any]:
    """Every thread's ``Cpus_allowed_list`` of process `pid`, read from ``/proc``; `error` when it cannot be read."""
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
        threads: dict[str, list[int]] = {}
        for tid in _thread_ids(pid):
            try:
                with open(f"/proc/{pid}/task/{tid}/status", encoding="utf-8") as f:
                    line = next(x for x in f if x.startswith("Cpus_allowed_list:"))
            except (FileNotFoundError, ProcessLookupError):
                continue  # the thread ended meanwhile
            threads[str(tid)] = parse_cores(line.split(":", 1)[1])
    except OSError as error:
        return {"pid": pid, "error": f"{type(error).__name__}: {error}"}
    return {
        "pid": pid,
        "name": status.get("Name", "").strip(),
        "cpus_allowed_list": parse_cores(status["Cpus_allowed_list"]),
        "threads": threads,
    }


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, grandchildren, ...), found through each process's parent in /proc."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                stat = f.read()
        except OSError:
            continue
        # the command name (field 2) may hold spaces and parentheses: the parent pid follows the last ')'
        parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return sorted(found)


def side_affinity(pid: int, *, reported: Sequence[int] | None = None) -> dict[str, Any]:
    """One side of the run: the process `pid` and every process below it, each with its threads' affinity.

    `reported`: what ``os.sched_getaffinity(0)`` returned inside that process (recorded beside /proc's).
    """
    return {
        "process": process_affinity(pid),
        "children": [process_affinity(child) for child in descendants(pid)],
        "sched_getaffinity": None if reported is None else sorted(reported),
    }


def pinning_problems(record: Mapping[str, Any], expected: Sequence[int], *, side: str,
                     min_children: int = 0) -> list[str]:
    """What differs between a `side_affinity` record and the cores the side should have; [] when it took."""
    want = sorted(expected)
    problems = []
    reported = record.get("sched_getaffinity")
    if reported is not None and sorted(reported) != want:
        problems.append(f"{side}: os.sched_getaffinity in the process returned {sorted(reported)}, expected {want}")
    processes = [record["process"], *record.get("children", [])]
    if len(record.get("children", [])) < min_children:
        problems.append(f"{side}: expected at least {min_children} process(es) below pid "
                        f"{record['process'].get('pid')} (the engine's), found {len(record.get('children', []))}")
    for proc in processes:
        if "error" in proc:
            problems.append(f"{side}: pid {proc['pid']} could not be read ({proc['error']})")
            continue
        if proc["cpus_allowed_list"] != want:
            problems.append(f"{side}: pid {proc['pid']} ({proc['name']}) has Cpus_allowed_list "
                            f"{cores_text(proc['cpus_allowed_list'])}, expected {cores_text(want)}")
        stray = {tid: cores for tid, cores in proc["threads"].items() if cores != want}
        if stray:
            shown = ", ".join(f"{tid}: {cores_text(c)}" for tid, c in sorted(stray.items())[:5])
            problems.append(f"{side}: pid {proc['pid']} has {len(stray)} thread(s) off {cores_text(want)} ({shown})")
    return problems


def cpu_times() -> dict[int, tuple[int, int]]:
    """Per core, (busy, total) jiffies since boot from /proc/stat (busy: all but idle and iowait)."""
    out = {}
    with open("/proc/stat", encoding="utf-8") as f:
        for line in f:
            name, *fields = line.split()
            if not name.startswith("cpu") or name == "cpu":
                continue
            values = [int(v) for v in fields]
            idle = values[3] + (values[4] if len(values) > 4 else 0)
            total = sum(values[:8])  # user..steal; guest time is already counted in user
            out[int(name[3:])] = (total - idle, total)
    return out


def busy_fractions(start: Mapping[int, tuple[int, int]], end: Mapping[int, tuple[int, int]]) -> dict[str, float | None]:
    """Per core, the fraction of the interval it was busy (None when no time passed)."""
    out: dict[str, float | None] = {}
    for core in sorted(start):
        busy = end[core][0] - start[core][0]
        total = end[core][1] - start[core][1]
        out[str(core)] = busy / total if total > 0 else None
    return out


def probe(actor: Any) -> tuple[int, list[int]]:
    """Run in an actor's process (``actor.__ray_call__.remote(probe)``): its pid and ``os.sched_getaffinity(0)``."""
    del actor  # the actor instance Ray passes; only its process matters
    return os.getpid(), sorted(os.sched_getaffinity(0))
