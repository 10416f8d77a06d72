"""vLLM's and Ray's console noise: the level setting reaches the engines and Ray, and the filters drop
exactly the listed known-harmless messages."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from flashrl.algorithms import FlashReinforceConfig
from flashrl.algorithms.flash_reinforce.config import ConfigError
from flashrl.engines.vllm_engine import VLLMEngineOptions
from flashrl.framework_logging import (
    HARMLESS_LOG_RECORDS,
    HARMLESS_WARNINGS,
    HarmlessLogFilter,
    child_pythonwarnings,
    install_filters,
    ray_logging_level,
    vllm_level,
    vllm_logging_args,
)
from flashrl.plan import plan_run

ROOT = Path(__file__).resolve().parents[1]

# The messages as vLLM 0.32 and Ray 2.60 print them (the tuned examples' starts), by their logger.
SEEN = [
    ("vllm.triton_utils.importing", "Triton is installed, but doesn't include CPU backend. Disabling Triton."),
    ("vllm.platforms.cpu", "Triton is not installed. triton-cpu is expected on x86 CPUs."),
    ("vllm.config.vllm", "Model Runner V2 requires Triton; using the V1 model runner instead."),
    ("vllm.engine.arg_utils", ("This model does not officially support disabling chunked prefill. Disabling this "
     "manually may cause the engine to crash or produce incorrect outputs.")),
    ("vllm.config.vllm", ("Enforce eager set, disabling torch.compile, CUDAGraphs, and JIT kernel warmup. This is "
     "equivalent to setting -cc.mode=none -cc.cudagraph_mode=none and --kernel_config.enable_jit_warmup=False")),
    ("vllm.config.vllm", ("Inductor compilation was disabled by user settings, optimizations settings that are only "
     "active during inductor compilation will be ignored.")),
    ("vllm.utils.ompmultiprocessing", "VLLM_CPU_NUM_OF_RESERVED_CPU is less than the minimum requirement: 1 cores"),
    ("vllm.v1.worker.cpu_worker", ("libtcmalloc is not found in LD_PRELOAD. For best performance, please follow the "
     "section `set LD_PRELOAD` in the docs to setup required pre-loaded libraries.")),
    ("vllm.v1.worker.cpu_worker", "libiomp is not found in LD_PRELOAD. For best performance, please follow ..."),
    ("vllm.utils.torch_utils", ("OMP_NUM_THREADS=2 is set; leaving Torch threads at 2 for serving. Multi-threaded "
     "torch CPU ops during serving can degrade performance through spin-wait contention and cgroup CPU-quota "
     "throttling.")),
    ("vllm.v1.engine.input_processor", ("Passing raw prompts to InputProcessor is deprecated and will be removed in "
     "the future. You should instead pass the outputs of Renderer.render_cmpl() or Renderer.render_chat().")),
    ("ray._private.authentication.authentication_token_setup", ("Token authentication is enabled for this Ray "
     "cluster. Set RAY_AUTH_MODE=disabled to opt out. For more information, see https://docs.ray.io/...")),
]
KEPT = [
    ("vllm.v1.worker.cpu_worker", "Available memory on node 0 is low"),  # a listed logger, an unlisted message
    ("vllm.engine.arg_utils", "Triton is not installed. triton-cpu is expected on x86 CPUs."),  # listed text, other logger
    ("ray._private.authentication.authentication_token_setup", "Token authentication is disabled for this Ray cluster."),
    ("vllm.entrypoints.llm", "Passing raw prompts to InputProcessor is deprecated"),
]


def _record(name: str, message: str, level: int = logging.WARNING) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, message, None, None)


def test_the_filter_drops_exactly_the_listed_records():
    keep = HarmlessLogFilter()
    assert [keep.filter(_record(*seen)) for seen in SEEN] == [False] * len(SEEN)
    assert [keep.filter(_record(*kept)) for kept in KEPT] == [True] * len(KEPT)
    assert keep.filter(_record(*SEEN[0], level=logging.ERROR))  # an error is never dropped
    # every listed record is among those seen (no entry is dead)
    assert {item.source for item in HARMLESS_LOG_RECORDS} == {name for name, _ in SEEN}


def test_installed_filters_drop_the_listed_warning_and_keep_others():
    listed = "`torch.distributed.reduce_op` is deprecated, please use `torch.distributed.ReduceOp` instead"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        install_filters()
        warnings.warn(listed, FutureWarning, stacklevel=1)
        warnings.warn("`torch.foo` is deprecated", FutureWarning, stacklevel=1)
        warnings.warn(listed, UserWarning, stacklevel=1)  # another category: kept
    assert [(w.category, str(w.message)) for w in caught] == [
        (FutureWarning, "`torch.foo` is deprecated"),
        (UserWarning, listed),
    ]
    assert len(HARMLESS_WARNINGS) == 1


def test_installed_filters_drop_the_listed_records_of_a_logger(caplog):
    install_filters()
    logger = logging.getLogger("vllm.utils.ompmultiprocessing")
    with caplog.at_level(logging.WARNING, logger="vllm.utils.ompmultiprocessing"):
        logger.warning("VLLM_CPU_NUM_OF_RESERVED_CPU is less than the minimum requirement: 1 cores")
        logger.warning("OMP threads bound to cores 0-1")
    assert [r.getMessage() for r in caplog.records] == ["OMP threads bound to cores 0-1"]


def test_child_processes_get_the_warning_filter_through_pythonwarnings():
    value = child_pythonwarnings("default::DeprecationWarning")
    assert value == "default::DeprecationWarning,ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning"
    assert child_pythonwarnings(value) == value  # idempotent
    code = ("import warnings\n"
            "warnings.warn('`torch.distributed.reduce_op` is deprecated, please use "
            "`torch.distributed.ReduceOp` instead', FutureWarning)\n"
            "warnings.warn('an unlisted warning', FutureWarning)\n")
    env = {**os.environ, "PYTHONWARNINGS": child_pythonwarnings(None)}
    err = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60,
                         check=False).stderr
    assert "an unlisted warning" in err
    assert "reduce_op" not in err


@pytest.mark.parametrize(
    ("level", "environ", "expected"),
    [
        ("WARNING", {}, "WARNING"),
        ("info", {}, "INFO"),
        ("WARNING", {"VLLM_LOGGING_LEVEL": "debug"}, "DEBUG"),  # the user's explicit level wins
        ("WARNING", {"VLLM_LOGGING_CONFIG_PATH": "/x.json"}, None),  # the user's own config: left alone
        (None, {}, None),
    ],
)
def test_vllm_level(level, environ, expected):
    assert vllm_level(level, environ) == expected


@pytest.mark.parametrize(
    ("level", "environ", "expected"),
    [("WARNING", {}, "WARNING"), ("WARNING", {"RAY_LOGGER_LEVEL": "debug"}, None), (None, {}, None)],
)
def test_ray_logging_level(level, environ, expected):
    assert ray_logging_level(level, environ) == expected


def test_the_setting_reaches_the_runners_engine_options():
    config = FlashReinforceConfig().env_runners(engine="vllm")
    assert config.framework_log_level == "WARNING"
    assert plan_run(config).engine_options["log_level"] == "WARNING"
    assert plan_run(config.reporting(framework_log_level="INFO")).engine_options["log_level"] == "INFO"
    assert plan_run(config.reporting(framework_log_level=None)).engine_options["log_level"] is None
    mine = config.env_runners(engine_options={"log_level": "ERROR"})
    assert plan_run(mine).engine_options["log_level"] == "ERROR"  # an explicit engine option wins
    assert "log_level" not in plan_run(FlashReinforceConfig().env_runners(engine="torch")).engine_options
    assert VLLMEngineOptions().log_level == "WARNING"  # an engine built without a run is quiet too


def test_a_wrong_level_is_refused():
    with pytest.raises(ConfigError, match=r"framework_log_level: expected None or one of .*got 'LOUD'"):
        FlashReinforceConfig().reporting(framework_log_level="LOUD").validate()


def test_vllm_applies_the_config_flashrl_hands_to_the_engine(tmp_path):
    """What vLLM's processes do with the engine's ``logging_config``: a fresh process applies it as vLLM's
    engine core does, then logs a listed warning, an unlisted one and an INFO line."""
    environ: dict[str, str] = {}
    args = vllm_logging_args("WARNING", environ)
    config = args["logging_config"]
    assert config.log_level == "WARNING"
    assert args["use_tqdm_on_load"] is False
    assert environ["PYTHONWARNINGS"] == child_pythonwarnings(None)
    written = json.loads(Path(config.pylogging_config_file).read_text(encoding="utf-8"))
    assert written["loggers"]["vllm"]["level"] == "WARNING"
    assert written["loggers"]["vllm.v1.worker.cpu_worker"] == {"filters": ["flashrl_harmless"]}
    assert vllm_logging_args("WARNING", {"VLLM_LOGGING_CONFIG_PATH": "/x.json"}) == {}
    code = (
        "from vllm.config.logging import LoggingConfig\n"
        "from vllm.logger import configure_logging, init_logger\n"
        f"configure_logging(LoggingConfig(log_level='WARNING', pylogging_config_file={config.pylogging_config_file!r}))\n"
        "log = init_logger('vllm.v1.worker.cpu_worker')\n"
        "log.warning('libtcmalloc is not found in LD_PRELOAD. For best performance, ...')\n"
        "log.warning('an unlisted vLLM warning')\n"
        "log.info('an INFO line')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("VLLM_LOGGING_LEVEL", None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, check=False)
    assert done.returncode == 0, done.stderr
    out = done.stdout + done.stderr
    assert "an unlisted vLLM warning" in out
    assert "libtcmalloc" not in out
    assert "an INFO line" not in out


def test_a_driver_started_cluster_is_quiet(tmp_path):
    """A real local cluster: the driver's Ray logger at WARNING, the INFO start line and the token notice gone."""
    code = (
        "import logging\n"
        "from flashrl.ray_utils import init_or_join\n"
        "print(init_or_join(framework_log_level='WARNING', num_cpus=1))\n"
        "print('ray logger level', logging.getLevelName(logging.getLogger('ray').level))\n"
        "import ray; ray.shutdown()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for key in ("RAY_ADDRESS", "RAY_LOGGER_LEVEL"):
        env.pop(key, None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-2:] == ["started", "ray logger level WARNING"]
    assert "Started a local Ray instance" not in done.stderr
    assert "Token authentication is enabled" not in done.stderr
