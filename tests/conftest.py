"""Shared test fixtures: the small real model, a tiny random-weight Llama and a tiny Qwen3-MoE.

All are session-scoped; the small model is cached on disk (`FLASHRL_CACHE` or the user cache dir), so
only the first session on a machine pays for the download and the dequantization.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

# Imported before any vLLM engine starts: hypothesis' pytest plugin imports it lazily at the end of
# the session, and on CPython 3.11 that late import (through pytest's assertion rewriter) can fail
# with "SystemError: AST constructor recursion depth mismatch" after vLLM has run in the process.
import hypothesis  # noqa: F401
import pytest

OPTIONAL_COMPONENTS: dict[str, tuple[tuple[str, ...], str]] = {
    "vllm": (("vllm",), "pip install -e '.[cpu]' (vLLM's CPU build) or '.[gpu]'"),
    "alfworld": (("alfworld", "textworld"), "pip install -e '.[alfworld]'"),
    "wandb": (("wandb",), "pip install -e '.[loggers]'"),
    "mlflow": (("mlflow",), "pip install -e '.[loggers]'"),
}
"""Marker -> (modules the marked tests need, how to install them)."""


def _missing(modules: tuple[str, ...]) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


def _require_optional() -> bool:
    """CI installs every extra, so there a missing optional component fails its tests."""
    flag = os.environ.get("FLASHRL_REQUIRE_OPTIONAL", os.environ.get("CI", ""))
    return flag.strip().lower() not in ("", "0", "false", "no")


@pytest.fixture(scope="session")
def require_optional() -> bool:
    """Whether a test that cannot find what it needs must fail instead of skipping (`_require_optional`)."""
    return _require_optional()


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Tests marked with an optional component skip, with the reason, when it is not installed.

    Under CI (``CI`` or ``FLASHRL_REQUIRE_OPTIONAL`` set) they fail instead: a CI run that skipped
    the vLLM tests would pass without testing the engine.
    """
    for marker, (modules, install) in OPTIONAL_COMPONENTS.items():
        if item.get_closest_marker(marker) is None:
            continue
        missing = _missing(modules)
        if not missing:
            continue
        message = f"needs {', '.join(missing)} (the {marker!r} marker): {install}"
        if _require_optional():
            pytest.fail(f"{message}. CI installs every extra, so this is an install failure.", pytrace=False)
        pytest.skip(message)


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """Local Hugging Face folder of SmolLM2-135M-Instruct (obtained offline, float32 safetensors)."""
    from flashrl.models import resolve_model

    return resolve_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def tiny_llama_path(smollm2_path: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random-weight Llama (2 layers, hidden 64) with SmolLM2's tokenizer and chat template."""
    from flashrl.models import build_tiny_llama

    out = Path(tmp_path_factory.mktemp("tiny_llama")) / "model"
    return build_tiny_llama(out, seed=0, tokenizer_source=smollm2_path)


@pytest.fixture(scope="session")
def tiny_qwen3_moe_path(smollm2_path: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random-weight Qwen3-MoE (2 layers, 8 experts, top-2) with SmolLM2's tokenizer and chat template."""
    from flashrl.models import build_tiny_qwen3_moe

    out = Path(tmp_path_factory.mktemp("tiny_qwen3_moe")) / "model"
    return build_tiny_qwen3_moe(out, seed=0, tokenizer_source=smollm2_path)


LOCAL_RAY_OPTIONS = {
    "num_cpus": 4,
    "include_dashboard": False,
    "log_to_driver": False,
    "runtime_env": {"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}},
}
"""``ray.init`` of the session's cluster (a test that starts its own cluster starts this one again after it)."""


@pytest.fixture(scope="session")
def local_ray_options() -> dict:
    return dict(LOCAL_RAY_OPTIONS)


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for the whole session (reused if one is already initialised).

    Four logical CPUs on a 2-core machine: actors ask for fractions of them deliberately, so nothing
    waits for a CPU that never frees up.
    """
    import ray

    if ray.is_initialized():
        yield ray
        return
    ray.init(**LOCAL_RAY_OPTIONS)
    try:
        yield ray
    finally:
        ray.shutdown()
