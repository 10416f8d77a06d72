"""A loss component is called once at validate() on a synthetic batch: a wrong return names the component,
what it returned and what the loss needs, before any actor starts."""

from __future__ import annotations

import pytest
import torch

from flashrl.algorithms import FlashReinforceConfig
from flashrl.algorithms.flash_reinforce.component_check import component_call_problems
from flashrl.algorithms.flash_reinforce.config import ConfigError


def scalar_baseline(rewards, *, group_ids=None):
    return rewards.mean()  # the bug: one number, not one advantage per trajectory


def raising_baseline(rewards, *, group_ids=None):
    return rewards - rewards[5]  # the bug: an index past B


class SequenceMask:
    def __call__(self, loss_mask, *, entropy=None, failures=None):
        return loss_mask.any(-1)  # the bug: [B], not [B, T]


def _config(**training):
    return FlashReinforceConfig().environment("flashrl/Math-v0", env_config={"preset": "easy_sums"}).training(**training)


def test_a_scalar_baseline_fails_validate_naming_it_and_the_shapes():
    with pytest.raises(ConfigError) as caught:
        _config(baseline=scalar_baseline).validate()
    assert ("baseline: expected a float tensor of advantages of shape [B] = [2] for rewards of shape [2] (one per "
            "trajectory) when called on a synthetic batch (B = 2, T = 3), got a torch.float32 tensor of shape [].") in str(
        caught.value
    )


def test_a_raising_baseline_and_a_wrong_token_mask_fail_validate_with_their_errors():
    with pytest.raises(ConfigError) as caught:
        _config(baseline=raising_baseline, token_mask=SequenceMask()).validate()
    text = str(caught.value)
    assert "baseline: expected a float tensor of advantages" in text
    assert "got IndexError: index 5 is out of bounds for dimension 0 with size 2." in text
    assert ("token_mask: expected a bool tensor of shape [B, T] = [2, 3] (a subset of loss_mask) when called on a "
            "synthetic batch (B = 2, T = 3), got a torch.bool tensor of shape [2].") in text


@pytest.mark.parametrize("baseline", ["batch_mean", "none", "leave_one_out"])
@pytest.mark.parametrize("trust_region", ["bernoulli_kl", "bernoulli_kl_exact", "tv", "none"])
def test_flashrl_s_own_components_pass(baseline, trust_region):
    loss = _config(baseline=baseline, trust_region=trust_region, aggregation="constant_length",
                   constant_length_normalizer=6144, negative_token_fraction=0.5).build_loss()
    assert component_call_problems(loss) == []
    assert component_call_problems(_config(importance_sampling="none", token_mask="all").build_loss()) == []
    assert torch.is_tensor(loss.component("baseline")(torch.tensor([1.0, 0.0]), group_ids=None))
