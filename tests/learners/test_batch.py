"""TrainBatch: padding, validation, success labels (rows for ranks and micro-batches: tests/learners/test_packing.py)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from flashrl.episode import Episode
from flashrl.learners import TrainBatch
from flashrl.learners.packing import gather_rows


def _episode(prompt_id: str, n_prompt: int, n_response: int, *, reward: float = 1.0, versions=(3,)) -> Episode:
    ids = list(range(10, 10 + n_prompt + n_response))
    return Episode(
        prompt_id=prompt_id,
        token_ids=ids,
        loss_mask=[False] * n_prompt + [True] * n_response,
        behavior_logprobs=[0.0] * n_prompt + [-0.5 - 0.1 * k for k in range(n_response)],
        reward=reward,
        policy_versions=list(versions),
    )


def test_from_episodes_pads_right_with_exact_values():
    a = _episode("a", 2, 3, reward=1.0, versions=(4, 2, 5))
    b = _episode("b", 1, 1, reward=-0.5, versions=())
    a.behavior_logprobs[0] = 7.0  # ignored: not a sampled token
    batch = TrainBatch.from_episodes([a, b], pad_token_id=99, group_ids=[7, 8])

    assert batch.token_ids.tolist() == [[10, 11, 12, 13, 14], [10, 11, 99, 99, 99]]
    assert batch.attention_mask.tolist() == [[True] * 5, [True, True, False, False, False]]
    assert batch.loss_mask.tolist() == [[False, False, True, True, True], [False, True, False, False, False]]
    torch.testing.assert_close(
        batch.behavior_logprobs, torch.tensor([[0.0, 0.0, -0.5, -0.6, -0.7], [0.0, -0.5, 0.0, 0.0, 0.0]])
    )
    assert batch.rewards.tolist() == [1.0, -0.5]
    assert batch.policy_versions.tolist() == [2, -1]  # oldest version; -1 when none was recorded
    assert batch.group_ids.tolist() == [7, 8]
    assert batch.prompt_ids == ["a", "b"]
    assert (batch.batch_size, batch.num_loss_tokens, batch.num_tokens) == (2, 4, 7)
    assert batch.token_ids.dtype == torch.long and batch.behavior_logprobs.dtype == torch.float32
    assert batch.non_finite_reason() is None


@pytest.mark.parametrize(
    ("episodes", "kwargs", "message"),
    [
        ([], {}, "at least one episode"),
        ([_episode("a", 2, 2)], {"pad_token_id": -1}, "pad_token_id"),
        ([_episode("a", 2, 2, reward=math.nan)], {}, "non-finite reward"),
        ([_episode("a", 2, 2, reward=math.inf)], {}, "non-finite reward"),
        ([_episode("a", 2, 2)], {"group_ids": [1, 2]}, "group_ids must have one entry"),
    ],
)
def test_from_episodes_rejects_bad_input(episodes, kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainBatch.from_episodes(episodes, **{"pad_token_id": 0, **kwargs})


def test_from_episodes_rejects_nan_logprob_first_sampled_token_and_empty_episode():
    bad = _episode("nan", 2, 2)
    bad.behavior_logprobs[3] = math.nan
    with pytest.raises(ValueError, match="non-finite behavior log-prob"):
        TrainBatch.from_episodes([bad], pad_token_id=0)
    first = Episode("first", [1, 2], [True, True], [-1.0, -1.0], 0.0)
    with pytest.raises(ValueError, match="position 0"):
        TrainBatch.from_episodes([first], pad_token_id=0)
    empty = Episode("empty", [], [], [], 0.0)
    with pytest.raises(ValueError, match="no tokens"):
        TrainBatch.from_episodes([empty], pad_token_id=0)


def test_constructor_checks_shapes_masks_and_signs():
    batch = TrainBatch.from_episodes([_episode("a", 2, 3), _episode("b", 3, 1)], pad_token_id=0)
    with pytest.raises(ValueError, match="rewards must have shape"):
        replace(batch, rewards=torch.zeros(3))
    with pytest.raises(ValueError, match="dtype torch.bool"):
        replace(batch, loss_mask=batch.loss_mask.long())
    with pytest.raises(ValueError, match="padding position"):
        replace(batch, loss_mask=torch.ones_like(batch.loss_mask).index_fill_(1, torch.tensor([0]), False))
    with pytest.raises(ValueError, match="must be <= 0"):
        replace(batch, behavior_logprobs=batch.behavior_logprobs.abs())
    left_padded = batch.attention_mask.flip(-1)
    with pytest.raises(ValueError, match="right-padded"):
        replace(batch, attention_mask=left_padded, loss_mask=torch.zeros_like(left_padded))
    with pytest.raises(ValueError, match="prompt_ids"):
        replace(batch, prompt_ids=["a"])


def test_non_finite_values_are_reported_not_rejected_by_the_constructor():
    batch = TrainBatch.from_episodes([_episode("a", 2, 3), _episode("b", 3, 1)], pad_token_id=0)
    assert replace(batch, rewards=torch.tensor([0.0, math.nan])).non_finite_reason() == "non_finite_rewards"
    logprobs = batch.behavior_logprobs.clone()
    logprobs[1, 3] = -math.inf
    assert replace(batch, behavior_logprobs=logprobs).non_finite_reason() == "non_finite_behavior_logprobs"
    logprobs = batch.behavior_logprobs.clone()
    logprobs[1, 4] = math.nan  # padding: nobody reads it
    assert replace(batch, behavior_logprobs=logprobs).non_finite_reason() is None


# --------------------------------------------------------------------------------------------------
# Success labels (the failure-token entropy filter's explicit failures).


def test_success_labels_come_from_the_env_info_and_travel_with_the_rows():
    import numpy as np

    a = _episode("a", 2, 3, reward=0.5)  # a positive reward that is NOT a success (e.g. a format bonus)
    a.info = {"success": False}
    a.__post_init__()
    b = Episode("b", [1, 2], [False, True], [0.0, -0.1], 0.0, info={"success": np.bool_(True)})
    c = Episode("c", [1, 2, 3], [False, True, True], [0.0, -0.1, -0.2], 0.0, success=True, info={"success": False})
    assert (a.success, b.success, c.success) == (False, True, True)  # an explicit field wins over info
    batch = TrainBatch.from_episodes([a, b, c], pad_token_id=0)
    assert batch.success.tolist() == [False, True, True]
    assert batch.failures.tolist() == [True, False, False]
    assert gather_rows(batch, [2, 0]).success.tolist() == [True, False]  # a micro-batch's rows keep them
    assert batch.rows(slice(0, 2)).failures.tolist() == [True, False]


def test_an_episode_without_a_label_leaves_the_batch_unlabelled_and_the_filter_refuses_it():
    labelled = Episode("a", [1, 2], [False, True], [0.0, -0.1], 1.0, info={"success": True})
    unlabelled = _episode("b", 1, 2, reward=1.0)  # reward 1, yet flashrl never guesses a label from it
    assert unlabelled.success is None
    batch = TrainBatch.from_episodes([labelled, unlabelled], pad_token_id=0)
    assert batch.success is None
    with pytest.raises(ValueError, match=r"no success labels .* info\['success'\]"):
        _ = batch.failures


def test_success_must_be_a_bool():
    with pytest.raises(TypeError, match=r"success \(info\['success'\]\) must be a bool or None; got 1"):
        Episode("a", [1, 2], [False, True], [0.0, -0.1], 1.0, info={"success": 1})
    batch = TrainBatch.from_episodes([_episode("a", 2, 3)], pad_token_id=0)
    with pytest.raises(ValueError, match="TrainBatch.success must have shape"):
        replace(batch, success=torch.tensor([1]))
