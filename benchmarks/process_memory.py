"""Peak resident memory of a run's processes on the CPU: one torch-engine EnvRunner and one learner (SmolLM2).

A short run is built the way ``flashrl train`` builds one (``config.build_algo()`` on a local Ray
cluster: the learner and the runner are Ray actors, each its own process) and trained for
``--iterations`` iterations. Then, before the run stops, every Ray worker process this driver started is
read from ``/proc``: the EnvRunner's and the learner's ``VmHWM`` (peak resident set size) and ``VmRSS``.
The dry run's estimates for the same config (``flashrl.plan.plan_run``: ``runner_memory`` and
``learner_memory``) with the code that ran sit beside them (``estimate_when_measured``; the committed
run's are those of a draft of the process terms, a 700 MiB baseline and the weights once more);
``tests/plan/test_memory.py`` holds the formula as it stands within 30% of the measured figures.

The config: SmolLM2-135M-Instruct in float32 (the engines' dtype on the CPU), AdamW, one env runner
with 4 episodes in flight on the arithmetic env (``flashrl/Math-v0``, ``easy_sums``: one short turn,
so the process, not the episodes, is what is measured), a learner actor with ``train_batch_size`` 4;
with the torch engine, and with ``--engines torch vllm`` also with vLLM's CPU build (whose engine
core is a child process of the runner: the runner's figure is then the sum of both processes' peaks,
an upper bound of their joint peak). A bare worker (a Ray actor that imports what every flashrl worker imports and loads the
model's tokenizer) is measured first: the baseline every process starts from. About a minute on two
quiet cores (the torch engine only).

    python benchmarks/process_memory.py       # writes benchmarks/results/process_memory.json, prints a table
    python benchmarks/process_memory.py --engines vllm --add   # adds vLLM's run, keeps the torch run

A bare worker with vLLM imported (``bare_vllm_worker``) is measured whenever vLLM runs (``--engines``
alone, with ``--add``: only the bare workers). The committed vLLM run was added this way, after the
torch run: its ``machine`` and ``bare_worker`` are its own.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _reports import write_json

OUT = Path(__file__).resolve().parent / "results" / "process_memory.json"
ROLES = {"EnvRunner": "env_runner", "LearnerActor": "learner", "_BareWorker": "bare_worker",
         "_BareVLLMWorker": "bare_vllm_worker"}
"""Ray's process title (``ray::<class>...``) of each actor measured, and its name here."""


def run_config(engine: str = "torch", batch: int = 4, new_tokens: int = 16):
    """The measured run: a torch-engine runner and a learner actor for SmolLM2 on the CPU."""
    from flashrl.algorithms import FlashReinforceConfig

    return (
        FlashReinforceConfig()
        .environment("flashrl/Math-v0", env_config={"preset": "easy_sums"})
        .env_runners(
            num_env_runners=1, num_cpus_per_env_runner=1.0, num_gpus_per_env_runner=0, engine=engine,
            episodes_in_flight_per_env_runner=batch, max_new_tokens=new_tokens, max_episode_tokens=256,
        )
        .learners(num_learners=1, num_cpus_per_learner=1.0, num_gpus_per_learner=0)
        .training(model="smollm2-135m-instruct", dtype="float32", optimizer="adamw", train_batch_size=batch,
                  lr=1e-6, delta=float("inf"))
        .reporting(tensorboard=False, console_every=0)
        .debugging(seed=0)
    )  # fmt: skip


def _status(pid: int) -> dict[str, int]:
    """``VmHWM`` and ``VmRSS`` of a process, in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            out[key] = int(value.split()[0]) * 1024
    return out


def _descendants_peak(proc) -> int:
    """Summed peak RSS of a process's children (vLLM's engine core under a runner)."""
    import psutil

    total = 0
    for child in proc.children(recursive=True):
        try:
            total += _status(child.pid)["VmHWM"]
        except (OSError, KeyError, psutil.Error):
            continue
    return total


def actor_processes() -> dict[str, dict[str, int]]:
    """This driver's Ray actor processes by role: their peak and current resident bytes."""
    import psutil

    found: dict[str, dict[str, int]] = {}
    for proc in psutil.Process(os.getpid()).children(recursive=True):  # the raylet's workers are ours
        try:
            title = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        for cls, role in ROLES.items():
            if title.startswith(f"ray::{cls}"):
                status = _status(proc.pid)
                children = _descendants_peak(proc)
                found[role] = {"pid": proc.pid, "peak_rss_bytes": status["VmHWM"] + children,
                               "process_peak_rss_bytes": status["VmHWM"], "children_peak_rss_bytes": children,
                               "rss_bytes": status["VmRSS"]}
    return found


class _BareWorker:
    """A Ray actor holding what every flashrl worker imports, and the model's tokenizer."""

    def __init__(self, model: str) -> None:
        from transformers import AutoTokenizer

        import flashrl.engines.torch_engine
        import flashrl.env_runners.env_runner
        import flashrl.learners.learner  # noqa: F401
        from flashrl.models import resolve_model

        self.tokenizer = AutoTokenizer.from_pretrained(resolve_model(model))

    def ready(self) -> bool:
        return True


class _BareVLLMWorker(_BareWorker):
    """A bare worker that also imports vLLM's CPU build as its engine does (each of a vLLM runner's two
    processes, the runner and the engine core, holds these imports)."""

    def __init__(self, model: str) -> None:
        super().__init__(model)
        from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: F401
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM  # noqa: F401

        assert current_platform.is_cpu()


def measure_bare(model: str, worker_class: type = _BareWorker) -> dict[str, int]:
    import ray

    role = ROLES[worker_class.__name__]
    worker = ray.remote(num_cpus=1)(worker_class).remote(model)
    ray.get(worker.ready.remote())
    out = actor_processes()[role]
    ray.kill(worker)
    return out


def measure_run(engine: str, iterations: int) -> dict:
    from flashrl.plan import plan_run

    config = run_config(engine)
    config.validate()
    plan = plan_run(config)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        algo = config.build_algo()
    try:
        tokens = []
        for _ in range(iterations):
            result = algo.train()
            tokens.append(result.get("learners/tokens_total"))
        processes = actor_processes()
    finally:
        algo.stop()
    missing = {"env_runner", "learner"} - set(processes)
    if missing:
        raise RuntimeError(f"no Ray process found for {sorted(missing)} (expected titles ray::EnvRunner, "
                           "ray::LearnerActor)")
    lm, rm = plan.learner_memory, plan.runner_memory
    return {
        "config": {"model": config.model, "dtype": config.dtype, "engine": config.engine,
                   "train_batch_size": config.train_batch_size,
                   "episodes_in_flight_per_env_runner": config.episodes_in_flight_per_env_runner,
                   "max_episode_tokens": config.max_episode_tokens, "max_new_tokens": config.max_new_tokens,
                   "iterations": iterations},
        "learner_tokens_per_update": tokens,
        "measured": {role: processes[role] for role in ("env_runner", "learner")},
        "estimate_when_measured": {  # the dry run's figures for this config with the code that ran
            "env_runner": {"weights": rm.weights, "kv_cache": rm.kv_cache,
                           "process": getattr(rm, "process", 0), "total": rm.total},
            "learner": {"static": lm.static, "activations": lm.activations,
                        "process": getattr(lm, "process", 0), "total": lm.total},
        },
        "seconds": time.perf_counter() - t0,
    }  # fmt: skip


def _machine() -> dict:
    return {"platform": platform.platform(), "python": platform.python_version(),
            "torch": __import__("torch").__version__, "cpus": os.cpu_count(),
            "load_average_at_start": os.getloadavg()}  # fmt: skip


def measure(iterations: int, engines: list[str], output: Path, *, add: bool = False) -> dict:
    """The bare worker, then one run per engine; the JSON is rewritten after each, so a run cut short
    keeps what was measured before it.

    ``add``: keep the output's recorded runs of the other engines and its bare worker; each new run
    then carries its own ``machine`` and ``bare_worker`` (measured under the same load as the run).
    """
    import ray

    result: dict = {"benchmark": "process_memory", "machine": _machine(), "runs": {}}
    if add and output.exists():
        result = json.loads(output.read_text())
    ray.init(num_cpus=4, num_gpus=0, include_dashboard=False, log_to_driver=False)
    try:
        bare = measure_bare("smollm2-135m-instruct")
        if not add:
            result["bare_worker"] = bare
            write_json(output, result)
        if "vllm" in engines or not engines:
            result["bare_vllm_worker"] = measure_bare("smollm2-135m-instruct", _BareVLLMWorker)
            write_json(output, result)
        for engine in engines:
            machine = _machine()
            try:
                run = measure_run(engine, iterations)
            except Exception as err:  # noqa: BLE001 - recorded: the other engine's figures still count
                run = {"error": repr(err)}
            result["runs"][engine] = {**run, "machine": machine, "bare_worker": bare} if add else run
            write_json(output, result)
    finally:
        ray.shutdown()
    return result


def table(result: dict) -> str:
    mib = 2**20
    rows = [f"bare worker (imports + tokenizer): peak {result['bare_worker']['peak_rss_bytes'] / mib:.0f} MiB",
            *([f"bare worker with vLLM imported: peak {result['bare_vllm_worker']['peak_rss_bytes'] / mib:.0f} MiB"]
              if "bare_vllm_worker" in result else []),
            "engine  process      peak RSS    RSS at end   estimate   estimate / peak"]
    for engine, run in result["runs"].items():
        if "error" in run:
            rows.append(f"{engine:<7} failed: {run['error']}")
            continue
        for role in ("env_runner", "learner"):
            m, e = run["measured"][role], run["estimate_when_measured"][role]
            rows.append(f"{engine:<7} {role:<12} {m['peak_rss_bytes'] / mib:7.0f} MiB {m['rss_bytes'] / mib:7.0f} MiB "
                        f"{e['total'] / mib:7.0f} MiB   {e['total'] / m['peak_rss_bytes']:.2f}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=2)
    p.add_argument("--engines", nargs="*", choices=["torch", "vllm"], default=["torch"],
                   help="engines to run (vllm: its CPU build, about a minute more); none: only the bare "
                        "workers (with --add: kept beside the recorded runs)")
    p.add_argument("--output", type=Path, default=OUT)
    p.add_argument("--add", action="store_true",
                   help="keep the output's runs of the engines not given (re-measure only these engines)")
    a = p.parse_args(argv)
    result = measure(a.iterations, a.engines, a.output, add=a.add)
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
