"""``FlashReinforce.restore_from_path`` loads only what the checkpoint's manifest lists.

Checkpoint A (one learner: a verified ``learner_state.pt``) gets checkpoint B's learner state copied
beside its own: B's DCP shards, ``.metadata`` and the ``optimizer_not_started`` marker, every weight
7.0. A single learner used to pick the shards because ``.metadata`` exists, so restoring A ran on B's
weights without an error. The restore must refuse the folder and leave the algorithm as it was.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch

from flashrl.checkpoints import CheckpointError

pytestmark = pytest.mark.ray

FILL = 7.0


def _dcp_state_of_another_run(folder: Path, model: str) -> None:
    from flashrl.algorithms.flash_reinforce.learner_loss import FlashReinforceLossSpec
    from flashrl.checkpoints import FRESH_OPTIMIZER_FILE, dcp
    from flashrl.learners import Learner, LearnerSpec

    other = Learner(LearnerSpec(model=model, device="cpu", optimizer="sgd", loss=FlashReinforceLossSpec(delta=1.0)))
    with torch.no_grad():
        for p in other.model.parameters():
            p.fill_(FILL)
    with warnings.catch_warnings():  # one process, no process group: DCP warns, as intended here
        warnings.simplefilter("ignore")
        dcp.save_sharded(folder, other.model, extra_state=other._extra_state())  # what a sharded rank writes
    (folder / FRESH_OPTIMIZER_FILE).touch()


def test_restore_from_path_never_loads_another_checkpoints_shards(ray_session, tiny_config, exact_sync_group,
                                                                 tiny_llama_path, tmp_path):
    algo = tiny_config(**exact_sync_group).build_algo()  # mixed rewards: an update moves the weights
    try:
        a = Path(algo.save_to_path(str(tmp_path / "a"), export_policy=False))
        saved = algo.learner_group.get_weights()
        algo.train()  # the run moves on: a restore of A must bring `saved` back
        algo.train()
        trained = algo.learner_group.get_weights()
        assert any(not torch.equal(trained[name], saved[name]) for name in saved)
        _dcp_state_of_another_run(tmp_path / "b", tiny_llama_path)
        added = sorted(p.name for p in (tmp_path / "b").iterdir())
        assert added == [".metadata", "__0_0.distcp", "optimizer_not_started"]
        for name in added:
            shutil.copy(tmp_path / "b" / name, a / "learner" / name)

        with pytest.raises(CheckpointError, match=r"learner/\.metadata: not listed in the manifest"):
            algo.restore_from_path(a)
        for name, tensor in algo.learner_group.get_weights().items():
            assert torch.equal(tensor, trained[name]), name  # nothing of B was loaded, nothing of A either

        for name in added:  # without the strays, A restores as saved
            (a / "learner" / name).unlink()
        algo.restore_from_path(a)
        for name, tensor in algo.learner_group.get_weights().items():
            assert torch.equal(tensor, saved[name]), name
    finally:
        algo.stop()
