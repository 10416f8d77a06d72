"""Outputs on shared storage: a `pyarrow.fs` URI (here file:// and a SubTreeFileSystem) the driver uploads to."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.fs
import pytest

from flashrl.checkpoints import MARKER, POLICY_DIR
from flashrl.recipes.storage import RemoteOutput, StorageError, is_uri


def _checkpoint(folder: Path) -> Path:
    (folder / POLICY_DIR).mkdir(parents=True)
    (folder / POLICY_DIR / "model.safetensors").write_bytes(b"weights")
    (folder / MARKER).write_text("{}")
    return folder


def _run(tmp_path: Path) -> Path:
    out = tmp_path / "staging"
    _checkpoint(out / "checkpoints" / "checkpoint_000001")
    _checkpoint(out / "checkpoint_final")
    (out / "tensorboard").mkdir()
    (out / "tensorboard" / "events.out").write_bytes(b"scalars")
    (out / "progress.jsonl").write_text('{"training_iteration": 1.0}\n')
    return out


def test_uris_and_paths_are_told_apart():
    assert is_uri("s3://bucket/run") and is_uri("file:///tmp/x") and is_uri("gs://b")
    assert not is_uri("/shared/runs/x") and not is_uri("~/flashrl_results") and not is_uri("C:/x") and not is_uri(None)


def test_a_file_uri_receives_the_run_and_pruned_checkpoints_go(tmp_path):
    out = _run(tmp_path)
    remote = RemoteOutput.resolve(f"file://{tmp_path}/bucket/run")
    uploaded = remote.sync_checkpoints(out / "checkpoints")
    assert uploaded == [f"file://{tmp_path}/bucket/run/checkpoints/checkpoint_000001"]
    assert remote.sync_checkpoints(out / "checkpoints") == []  # already there
    target = tmp_path / "bucket" / "run"
    assert (target / "checkpoints" / "checkpoint_000001" / POLICY_DIR / "model.safetensors").read_bytes() == b"weights"
    # a newer checkpoint, the older one pruned locally (num_checkpoints_to_keep): the same there
    _checkpoint(out / "checkpoints" / "checkpoint_000002")
    import shutil

    shutil.rmtree(out / "checkpoints" / "checkpoint_000001")
    remote.upload_run(out)
    assert sorted(p.name for p in (target / "checkpoints").iterdir()) == ["checkpoint_000002"]
    assert (target / "checkpoint_final" / MARKER).is_file()
    assert (target / "tensorboard" / "events.out").read_bytes() == b"scalars"
    assert (target / "progress.jsonl").read_text() == '{"training_iteration": 1.0}\n'


def test_a_subtree_filesystem_and_a_checkpoint_without_its_policy(tmp_path):
    base = tmp_path / "mount"
    base.mkdir()
    remote = RemoteOutput("mem://run", pyarrow.fs.SubTreeFileSystem(str(base), pyarrow.fs.LocalFileSystem()), "run")
    out = _run(tmp_path)
    remote.upload_run(out)
    assert (base / "run" / "checkpoint_final" / POLICY_DIR / "model.safetensors").is_file()
    # learner rank 0 on another node: the policy folder is not on the driver's node
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / MARKER).write_text("{}")
    with pytest.raises(StorageError, match=r"expected \['policy'\] on the driver's node"):
        remote.upload_checkpoint(partial, "checkpoint_x")


def test_an_unknown_scheme_and_a_uri_in_the_config_are_clear_errors():
    with pytest.raises(StorageError, match="Unrecognized filesystem type"):
        RemoteOutput.resolve("nosuchfs://bucket/run")
    from flashrl.algorithms import FlashReinforceConfig

    config = FlashReinforceConfig().environment("flashrl/Math-v0").checkpointing(checkpoint_dir="s3://bucket/ckpt")
    with pytest.raises(ValueError, match="checkpoint_dir: expected None or a local folder"):
        config.validate()


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_train_uploads_checkpoints_and_logs_to_a_file_uri(ray_cluster, tiny_llama_path, tmp_path, monkeypatch):
    from flashrl.algorithms import FlashReinforceConfig
    from flashrl.recipes.preset import NodePlan, Preset
    from flashrl.recipes.run import train

    monkeypatch.setenv("FLASHRL_RESULTS", str(tmp_path / "results"))  # the local staging folder's root
    config = (
        FlashReinforceConfig()
        .environment("flashrl/Math-v0", env_config={"preset": "easy_sums"})
        .env_runners(num_env_runners=1, num_cpus_per_env_runner=0.5, engine="torch",
                     episodes_in_flight_per_env_runner=4, max_new_tokens=8, max_episode_tokens=128)
        .learners(num_learners=0, num_cpus_per_learner=0.5)
        .training(model=tiny_llama_path, lr=1e-3, train_batch_size=4)
        .checkpointing(checkpoint_frequency=1, num_checkpoints_to_keep=1)
        .reporting(console_every=0)
        .resources(num_cpus_for_main_process=0.25)
    )
    preset = Preset(name="storage_test", description="tiny", success_metric="never/reached",
                    success_threshold=float("inf"), stop_iters=2, node_plan=NodePlan(num_nodes=1, gpus_per_node=0),
                    needs_gpu=False)
    summary = train(config, preset, stop_iters=2, stop_reward=float("inf"), output=f"file://{tmp_path}/bucket")
    target = tmp_path / "bucket"
    assert Path(summary.output).is_relative_to(tmp_path / "results" / "storage_test")  # staged locally
    assert sorted(p.name for p in (target / "checkpoints").iterdir()) == ["checkpoint_000002"]  # pruned there too
    for folder in (target / "checkpoints" / "checkpoint_000002", target / "checkpoint_final"):
        assert (folder / MARKER).is_file() and (folder / POLICY_DIR / "config.json").is_file()
    assert list((target / "tensorboard").glob("events.out.tfevents.*"))
    rows = [json.loads(line) for line in (target / "progress.jsonl").read_text().splitlines()]
    assert [r["training_iteration"] for r in rows] == [1.0, 2.0]
    assert json.loads((target / "result.json").read_text())["iterations"] == 2
    assert (target / "curves.png").is_file()
