"""`--resume latest` reads a run folder as untrusted input: a FIFO where a checkpoint's state belongs
is skipped at once (reading it would block forever), and the newest readable checkpoint is taken."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from flashrl.checkpoints import ALGORITHM_STATE_FILE, MARKER
from flashrl.recipes.args import find_checkpoint


def _checkpoint(folder: Path, iteration: int) -> Path:
    folder.mkdir(parents=True)
    (folder / MARKER).write_text("{}")
    (folder / ALGORITHM_STATE_FILE).write_text(json.dumps({"iteration": iteration}))
    return folder


def test_a_fifo_state_file_is_skipped_not_read(tmp_path: Path) -> None:
    run = tmp_path / "run"
    good = _checkpoint(run / "checkpoints" / "checkpoint_000002", 2)
    planted = run / "checkpoints" / "checkpoint_000009"
    planted.mkdir(parents=True)
    (planted / MARKER).write_text("{}")
    os.mkfifo(planted / ALGORITHM_STATE_FILE)
    found: list = []
    worker = threading.Thread(target=lambda: found.append(find_checkpoint("latest", str(run), "job")), daemon=True)
    worker.start()
    worker.join(timeout=20)
    assert not worker.is_alive(), "--resume latest blocked on a FIFO in the run folder"
    assert found == [(good, run.resolve())]
