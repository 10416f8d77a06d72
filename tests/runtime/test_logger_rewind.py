"""A resumed run's logs continue its checkpoint's timeline: the rows a killed run wrote past the
checkpoint leave progress.jsonl (for a side file) and progress.csv, and TensorBoard purges those steps."""

from __future__ import annotations

import csv
import json

from flashrl.loggers import CSVLogger, JsonLinesLogger, TensorBoardLogger
from flashrl.loggers.rewind import discarded_path, rewind_jsonl


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_jsonl_logger_moves_the_rows_past_the_checkpoint_to_a_side_file(tmp_path):
    logger = JsonLinesLogger(tmp_path)
    for step in range(5):  # 0: an evaluation before the first update
        logger.log(step, {"x": float(step)})
    logger.rewind(2)
    logger.log(3, {"x": 30.0})
    logger.close()
    rows = _lines(tmp_path / "progress.jsonl")
    assert rows == [{"training_iteration": float(i), "x": float(i)} for i in range(3)] + [
        {"training_iteration": 3.0, "x": 30.0}
    ]
    assert _lines(tmp_path / "progress.discarded.jsonl") == [
        {"discarded_by_resume_from_iteration": 2.0},
        {"training_iteration": 3.0, "x": 3.0},
        {"training_iteration": 4.0, "x": 4.0},
    ]


def test_rewind_cuts_at_a_line_a_kill_cut_short_and_keeps_rows_without_an_iteration(tmp_path):
    path = tmp_path / "progress.jsonl"
    path.write_text('{"training_iteration": 1.0}\n{"resumed_from_iteration": 1.0}\n{"training_it', encoding="utf-8")
    assert rewind_jsonl(path, 1) == 1
    assert _lines(path) == [{"training_iteration": 1.0}, {"resumed_from_iteration": 1.0}]
    assert discarded_path(path).endswith("progress.discarded.jsonl")
    assert (tmp_path / "progress.discarded.jsonl").read_text(encoding="utf-8").splitlines() == [
        '{"discarded_by_resume_from_iteration": 1.0}', '{"training_it'
    ]
    assert rewind_jsonl(path, 1) == 0  # nothing past 1 any more: no second marker
    assert rewind_jsonl(tmp_path / "missing.jsonl", 1) == 0


def test_csv_logger_drops_the_rows_past_the_checkpoint(tmp_path):
    logger = CSVLogger(tmp_path)
    for step in (1, 2, 3, 4):
        logger.log(step, {"x": float(step)})
    logger.rewind(2)
    logger.log(3, {"x": 30.0})
    with open(tmp_path / "progress.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert rows == [
        {"training_iteration": "1.0", "x": "1.0"},
        {"training_iteration": "2.0", "x": "2.0"},
        {"training_iteration": "3.0", "x": "30.0"},
    ]


def test_tensorboard_purges_the_steps_past_the_checkpoint(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(tmp_path)
    for step in (1, 2, 3, 4):
        logger.log(step, {"x": float(step)})
    logger.rewind(2)
    for step in (3, 4):
        logger.log(step, {"x": 10.0 * step})
    logger.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("x")] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
