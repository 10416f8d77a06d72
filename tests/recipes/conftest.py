"""Fixtures of the recipe tests: the tuned examples folder, offline hub, a private cache for outputs."""

from __future__ import annotations

from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "tuned_examples"


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No hub probe (the dry-run must not need a network) and outputs under tmp_path."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("FLASHRL_TUNED_EXAMPLES", str(EXAMPLES))
    monkeypatch.chdir(tmp_path)
