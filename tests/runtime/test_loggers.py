"""Loggers: progress.csv and progress.jsonl always, Weights & Biases (offline) and MLflow (a file store)
on request, each with the keys TensorBoard gets; a run writes them all."""

from __future__ import annotations

import csv
import glob
import json
import math
import os

import pytest

from flashrl.algorithms.flash_reinforce.config import ConfigError, FlashReinforceConfig
from flashrl.loggers import CSVLogger, JsonLinesLogger, build_loggers, register_logger
from flashrl.loggers.base import ResultLogger
from flashrl.loggers.mlflow_logger import mlflow_key


def _csv_rows(path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _jsonl_rows(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def wandb_history(run_dir: str) -> list[dict[str, str]]:
    """The history rows (key -> JSON value) of an offline wandb run, read from its ``run-*.wandb`` file.

    The file is a LevelDB-style log (a 7-byte header ``:W&B`` + magic + version, then 32 KiB blocks of
    chunks: checksum (4), length (2, little endian), type (1: full, 2: first, 3: middle, 4: last)) of
    ``wandb_internal_pb2.Record`` messages; wandb 0.31 ships no Python reader of it.
    """
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B"
    pos, block, buf, rows = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's zero-padded tail
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): item.value_json for item in record.history.item})
    return rows


# -- the files, by hand --------------------------------------------------------------------------------
def test_csv_widens_its_header_for_a_key_that_appears_later_and_appends_on_reopen(tmp_path):
    logger = CSVLogger(tmp_path)
    logger.log(1, {"a": 1.5, "flag": True, "text": "x", "n": 3})
    logger.log(2, {"a": float("nan"), "evaluation/avg@4": 0.25})  # a new column, and a NaN
    logger.close()
    CSVLogger(tmp_path).log(3, {"a": 2.0})  # a resumed run writing to the same folder
    rows = _csv_rows(tmp_path / "progress.csv")
    assert list(rows[0]) == ["training_iteration", "a", "n", "evaluation/avg@4"]  # numbers only, bools are not
    assert rows == [
        {"training_iteration": "1.0", "a": "1.5", "n": "3.0", "evaluation/avg@4": ""},
        {"training_iteration": "2.0", "a": "", "n": "", "evaluation/avg@4": "0.25"},
        {"training_iteration": "3.0", "a": "2.0", "n": "", "evaluation/avg@4": ""},
    ]


def test_json_lines_are_strict_json_with_null_for_non_finite_values(tmp_path):
    logger = JsonLinesLogger(tmp_path)
    logger.log(0, {"evaluation/avg@4": 0.5})
    logger.log(1, {"a": float("inf"), "b": 2, "skip": "text"})
    logger.close()
    text = (tmp_path / "progress.jsonl").read_text()
    assert "Infinity" not in text and "NaN" not in text
    assert _jsonl_rows(tmp_path / "progress.jsonl") == [
        {"training_iteration": 0.0, "evaluation/avg@4": 0.5},
        {"training_iteration": 1.0, "a": None, "b": 2.0},
    ]


def test_mlflow_keys():
    assert mlflow_key("evaluation/avg@4") == "evaluation/avg_at_4"
    assert mlflow_key("evaluation/gsm8k/pass@32") == "evaluation/gsm8k/pass_at_32"
    assert mlflow_key("learners/drift_max") == "learners/drift_max"
    assert mlflow_key("a#b c:d") == "a_b c:d"


def test_the_settings_are_checked_before_anything_starts():
    config = FlashReinforceConfig().reporting(loggers=["wandb", "neptune", "wandb"], logger_options={"comet": {}})
    with pytest.raises(ConfigError) as info:
        config.validate()
    text = str(info.value)
    assert "loggers: expected names among ['mlflow', 'wandb'], got 'neptune'" in text
    assert "loggers: expected each name once, got ['wandb', 'neptune', 'wandb']" in text
    assert "logger_options: expected options only for the loggers in use" in text and "['comet']" in text
    with pytest.raises(ConfigError, match="logger_options: expected a dict of logger name -> dict"):
        FlashReinforceConfig().reporting(loggers=["mlflow"], logger_options={"mlflow": "x"}).validate()


def test_a_missing_tracker_library_names_the_extra(monkeypatch, tmp_path):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # importing it now raises ImportError
    from flashrl.loggers import WandbLogger

    with pytest.raises(ImportError, match=r"'wandb' needs the 'wandb' package.*pip install 'flashrl\[loggers\]'"):
        WandbLogger(tmp_path)


def test_a_registered_backend_is_built_by_name_and_all_are_closed_if_one_fails(tmp_path):
    seen = []

    class Recorder(ResultLogger):
        def __init__(self, log_dir, *, config=None, run_name=None, **options):
            seen.append(("init", run_name, options))

        def log(self, step, scalars, histograms=None):
            seen.append(("log", step, dict(scalars)))

        def close(self):
            seen.append(("close",))

    class Broken(Recorder):
        def __init__(self, log_dir, **kwargs):
            raise RuntimeError("tracker unreachable")

    register_logger("test-recorder")(Recorder)
    register_logger("test-broken")(Broken)
    loggers = build_loggers(tmp_path, names=["test-recorder"], options={"test-recorder": {"k": 1}}, run_name="r")
    assert [type(x).__name__ for x in loggers] == ["CSVLogger", "JsonLinesLogger", "Recorder"]
    loggers[-1].log(1, {"a": 1.0})
    with pytest.raises(RuntimeError, match="tracker unreachable"):
        build_loggers(tmp_path / "2", names=["test-recorder", "test-broken"])
    assert seen == [("init", "r", {"k": 1}), ("log", 1, {"a": 1.0}), ("init", None, {}), ("close",)]


# -- a real run: Ray actors, the tiny model, the torch engine --------------------------------------------
@pytest.mark.ray
@pytest.mark.wandb
@pytest.mark.mlflow
def test_a_run_writes_the_same_keys_to_every_logger(ray_session, tiny_config, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")  # wandb's own switch: no network, no account
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracking_uri = (tmp_path / "mlruns").as_uri()
    config = tiny_config(
        results_dir=str(tmp_path / "results"),
        loggers=["wandb", "mlflow"],
        logger_options={"mlflow": {"tracking_uri": tracking_uri, "experiment_name": "loggers-test"}},
        evaluation_interval=2,
        evaluation_num_episodes=2,
    )
    algo = config.build_algo()
    try:
        results = [algo.train() for _ in range(2)]
    finally:
        algo.stop()

    acc = EventAccumulator(config.log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    tensorboard = {}  # step -> {tag: value}
    for tag in acc.Tags()["scalars"]:
        for event in acc.Scalars(tag):
            tensorboard.setdefault(event.step, {})[tag] = event.value
    assert sorted(tensorboard) == [1, 2]
    assert "evaluation/avg@1" in tensorboard[2] and "evaluation/avg@1" not in tensorboard[1]

    rows = _jsonl_rows(tmp_path / "results" / "progress.jsonl")
    assert [row["training_iteration"] for row in rows] == [1.0, 2.0]
    for row, result in zip(rows, results):
        step = int(row.pop("training_iteration"))
        assert {k for k, v in row.items() if v is not None} == set(tensorboard[step])
        for key, value in tensorboard[step].items():
            assert row[key] == pytest.approx(value, rel=1e-6)  # TensorBoard stores float32
            assert row[key] == result[key]  # what train() returned

    csv_rows = _csv_rows(tmp_path / "results" / "progress.csv")
    assert len(csv_rows) == 2
    for row, json_row in zip(csv_rows, rows):
        assert float(row.pop("training_iteration")) in (1.0, 2.0)
        assert {k for k, v in row.items() if v != ""} == {k for k, v in json_row.items() if v is not None}
        assert all(float(row[k]) == v for k, v in json_row.items() if v is not None)

    (wandb_dir,) = glob.glob(str(tmp_path / "results" / "wandb" / "offline-run-*"))
    history = wandb_history(wandb_dir)
    assert [json.loads(h["training_iteration"]) for h in history] == [1, 2]
    for entry, json_row in zip(history, rows):
        logged = {k: json.loads(v) for k, v in entry.items() if not k.startswith(("_", "hist/"))}
        assert logged == {k: v for k, v in json_row.items() if v is not None} | {"training_iteration": logged["training_iteration"]}
    assert "hist/policy_lag/_type" in history[0]  # the histograms go to wandb too

    client = MlflowClient(tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("loggers-test").experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.params["train_batch_size"] == "4" and run.data.params["loggers"] == '["wandb", "mlflow"]'
    for key in tensorboard[1]:
        history = client.get_metric_history(run.info.run_id, mlflow_key(key))
        expected = [(step, rows[step - 1][key]) for step in (1, 2) if rows[step - 1].get(key) is not None]
        assert [(m.step, m.value) for m in history] == expected, key
    assert [m.step for m in client.get_metric_history(run.info.run_id, "evaluation/avg_at_1")] == [2]
    assert not math.isnan(results[-1]["evaluation/avg@1"])
