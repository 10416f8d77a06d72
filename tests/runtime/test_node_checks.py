"""The setup check of a cluster's nodes (flashrl.ray_utils.check_cluster_nodes): another Ray, flashrl or Python version than
the driver's, or a checkpoint folder a node cannot share or write, is refused at start naming the node."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from flashrl.ray_utils import (
    PROBE_PREFIX,
    NodeCheckError,
    NodeReport,
    check_cluster_nodes,
    compare_nodes,
    local_versions,
    node_report,
    probe_folder,
)

DRIVER = {"python": "3.11", "ray": "2.60.0", "flashrl": "0.1.0"}


def test_a_node_with_another_version_is_named_with_what_differs_and_the_fix():
    same = NodeReport(node="10.0.0.1 (node aaa)", versions=dict(DRIVER))
    old_ray = NodeReport(node="10.0.0.2 (node bbb)", versions={**DRIVER, "ray": "2.59.0"})
    two = NodeReport(node="10.0.0.3 (node ccc)", versions={**DRIVER, "python": "3.12", "flashrl": "0.0.9"})
    assert compare_nodes(DRIVER, [same]) == []
    problems = compare_nodes(DRIVER, [same, old_ray, two])
    assert len(problems) == 2
    assert problems[0].startswith("node 10.0.0.2 (node bbb) runs ray 2.59.0 (the driver has 2.60.0). Fix: install")
    assert "ray==2.60.0" in problems[0] and "flashrl==0.1.0" in problems[0]
    assert "python 3.12 (the driver has 3.11), flashrl 0.0.9 (the driver has 0.1.0)" in problems[1]
    assert "10.0.0.3" in problems[1] and "2.60.0 (the driver" not in problems[1]


def test_a_node_that_cannot_use_the_folder_is_named_with_the_path():
    report = NodeReport(node="10.0.0.2 (node bbb)", versions=dict(DRIVER),
                        folder_errors={"/shared/ckpt": "cannot write there (Permission denied)"})
    (problem,) = compare_nodes(DRIVER, [report])
    assert problem.startswith("node 10.0.0.2 (node bbb) cannot write there (Permission denied): /shared/ckpt. Fix:")
    assert "every node mounts read-write at the same path" in problem


def test_probe_folder_reads_the_driver_s_file_writes_its_own_and_leaves_nothing(tmp_path):
    folder = tmp_path / "a" / "b"
    assert probe_folder(str(folder)) is None
    assert not (tmp_path / "a").exists()  # the folders the probe made are removed again
    tmp_path.joinpath("x").mkdir()
    (tmp_path / "x" / "p").write_text("token")
    assert probe_folder(str(tmp_path / "x"), expect=("p", "token")) is None
    assert sorted(os.listdir(tmp_path / "x")) == ["p"]  # the driver's probe is the driver's to remove
    unshared = probe_folder(str(tmp_path / "x"), expect=("missing", "token"))
    assert unshared.startswith("cannot read the probe file the driver wrote there")
    assert "not storage this node shares" in unshared
    assert "another file" in probe_folder(str(tmp_path / "x"), expect=("p", "other"))


def _unwritable(tmp_path):
    """A folder this user cannot write into: read-only by chmod, or for root (whom chmod does not bind) a
    path under /proc, where nobody can create a folder."""
    if os.geteuid() == 0:
        return Path("/proc/flashrl_node_check_checkpoints")
    folder = tmp_path / "read_only"
    folder.mkdir()
    folder.chmod(stat.S_IRUSR | stat.S_IXUSR)
    return folder


def test_an_unwritable_checkpoint_folder_fails_the_check_with_its_path(tmp_path, ray_cluster):
    folder = _unwritable(tmp_path)
    assert probe_folder(str(folder)).startswith("cannot write there (")
    with pytest.raises(NodeCheckError) as info:
        check_cluster_nodes([str(folder)])
    assert "(the driver's) cannot write there (" in str(info.value) and f"): {folder}. Fix:" in str(info.value)
    check_cluster_nodes([str(tmp_path)])  # a writable one passes, and keeps no probe file
    assert not [n for n in os.listdir(tmp_path) if n.startswith(PROBE_PREFIX)]
    check_cluster_nodes([str(tmp_path / "new" / "checkpoints")])  # a folder not made yet: made, then removed
    assert not (tmp_path / "new").exists()


def test_a_run_with_an_unwritable_checkpoint_folder_stops_at_setup_naming_it(tmp_path, ray_cluster, monkeypatch):
    """Before, the first periodic save failed an interval into the run (and the run went on without one)."""
    from flashrl.algorithms import FlashReinforceConfig
    from flashrl.algorithms.flash_reinforce import algorithm as algorithm_module

    built = []
    monkeypatch.setattr(algorithm_module.FlashReinforce, "_new_learner_group", lambda self: built.append(1))
    folder = _unwritable(tmp_path)
    config = (FlashReinforceConfig().environment("flashrl/Math-v0", env_config={"preset": "easy_sums"})
              .env_runners(engine="torch").checkpointing(checkpoint_frequency=1, checkpoint_dir=str(folder)))
    with pytest.raises(NodeCheckError, match=f"cannot write there .*: {folder}. Fix: put the run's storage"):
        algorithm_module.FlashReinforce(config=config)
    assert built == []  # nothing started


def test_a_node_s_report_comes_from_a_task_pinned_to_that_node(tmp_path, ray_cluster):
    """The per-node task, run for real on this (the only) node, reads the driver's probe and writes its own."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    (tmp_path / "probe").write_text("abc")
    here = ray.get_runtime_context().get_node_id()
    task = ray.remote(num_cpus=0)(node_report).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False))
    report = ray.get(task.remote("this node", {str(tmp_path): ("probe", "abc"), "/proc/x": ("probe", "abc")}))
    assert report.versions == local_versions() and set(report.versions) == {"python", "ray", "flashrl"}
    assert list(report.folder_errors) == ["/proc/x"] and "not storage this node shares" in report.folder_errors["/proc/x"]


def test_every_other_node_is_checked_by_its_own_task_end_to_end(tmp_path, ray_cluster, monkeypatch):
    """This machine's node, taken for another node than the driver's: its task reads the driver's probe in
    the folder and reports its versions, which differ from the driver's (flashrl's, patched in the driver
    only), so the check names that node and the version."""
    import ray

    from flashrl import ray_utils

    real = local_versions()

    class Elsewhere:
        def get_node_id(self) -> str:
            return "f" * 56  # the driver is on no node of the cluster, so the real node is checked by a task

    monkeypatch.setattr(ray, "get_runtime_context", lambda: Elsewhere())
    monkeypatch.setattr(ray_utils, "local_versions", lambda: {**real, "flashrl": "9.9.9"})
    with pytest.raises(NodeCheckError) as info:
        check_cluster_nodes([str(tmp_path)])
    (node,) = [n for n in ray.nodes() if n["Alive"]]
    text = str(info.value)
    assert f"node {node['NodeManagerAddress']} (node {node['NodeID'][:12]}) runs flashrl {real['flashrl']} (the " \
           "driver has 9.9.9)" in text
    assert text.count("\n  - ") == 1  # nothing about the folder: it read the driver's probe and wrote its own
    assert os.listdir(tmp_path) == []
