"""The weight-sync tests use the fixtures of the engine, learner and runtime tests.

Those live in the conftest of each folder, so they are loaded here by path (a conftest is not an
importable module) and re-exported: the engines' event loop and chat prompts, the learners' specs
and batches, the runtime's Ray session, tiny run config and test environments.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

TESTS = Path(__file__).resolve().parents[1]


def _load(folder: str) -> ModuleType:
    name = f"flashrl_tests_{folder}_fixtures"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, TESTS / folder / "conftest.py")
    assert spec is not None and spec.loader is not None, f"no conftest.py in tests/{folder}"
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: the runtime's registers itself for Ray by name
    spec.loader.exec_module(module)
    return module


_engines, _learners, _runtime = _load("engines"), _load("learners"), _load("runtime")

chat_prompts = _engines.chat_prompts
event_loop_runner = _engines.event_loop_runner
make_spec = _learners.make_spec
episodes = _learners.episodes
batch = _learners.batch
ray_session = _runtime.ray_session
tiny_config = _runtime.tiny_config
replacement_versions = _runtime.replacement_versions
