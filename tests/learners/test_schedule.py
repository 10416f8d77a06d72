"""Learning-rate schedules, the AdamW settings and parameter groups, and the schedule across a restore.

The schedules follow Molt (``molt/trainer/fsdp/strategy.py``): warmup = ceil(N * ratio) updates, the
scheduler stepped after each optimizer step; Molt's AdamW keeps every parameter in one group.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from flashrl.learners import OPTIMIZERS, Learner, LearnerSpec
from flashrl.learners.schedule import cosine_with_min_lr_factor, make_lr_scheduler, warmup_updates


def _lrs(spec: LearnerSpec, steps: int) -> list[float]:
    """The lr of updates 0 .. steps-1 under the spec's schedule (as the learner applies them)."""
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=spec.lr)
    scheduler = make_lr_scheduler(optimizer, spec)
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


def test_cosine_with_min_lr_exact_values():
    # N = 10, warmup ratio 0.2 -> W = ceil(2.0) = 2; min ratio 0.1; lr 1e-3.
    #  k = 0: 0/2 -> 0;  k = 1: 1/2 -> 5e-4;  k = 2: progress 0 -> 1e-3
    #  k = 3: progress 1/8: 0.1 + 0.9 (1 + cos(pi/8)) / 2 = 0.1 + 0.9 * 0.9619398 = 0.9657458 -> 9.657458e-4
    #  k = 6: progress 4/8: 0.1 + 0.9 * 0.5 = 0.55 -> 5.5e-4
    #  k = 10: progress 1: 0.1 -> 1e-4;  k = 11, 12: held at 1e-4 (past the horizon)
    spec = LearnerSpec(model="m", lr=1e-3, lr_schedule="cosine_with_min_lr", total_updates=10,
                       lr_warmup_ratio=0.2, min_lr_ratio=0.1)
    lrs = _lrs(spec, 13)
    expected = {0: 0.0, 1: 5e-4, 2: 1e-3, 3: 9.657458e-4, 6: 5.5e-4, 10: 1e-4, 11: 1e-4, 12: 1e-4}
    for k, lr in expected.items():
        assert lrs[k] == pytest.approx(lr, rel=1e-6, abs=1e-15), k
    assert all(a >= b for a, b in itertools.pairwise(lrs[2:]))  # non-increasing after the warmup


def test_constant_schedule_and_the_molt_warmup_length():
    assert _lrs(LearnerSpec(model="m", lr=3e-6), 4) == [3e-6] * 4
    # Molt's ceil(N * ratio): the reference's 0.03 over 100 updates is 3, over 128 it is ceil(3.84) = 4.
    assert (warmup_updates(100, 0.03), warmup_updates(128, 0.03), warmup_updates(10, 0.0)) == (3, 4, 0)


def test_cosine_agrees_with_transformers_within_the_horizon():
    # transformers' `cosine_with_min_lr` is what Molt calls; flashrl's factor equals it up to the horizon.
    from transformers import get_scheduler

    total, ratio, floor = 37, 0.1, 0.2
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=1.0)
    reference = get_scheduler("cosine_with_min_lr", optimizer, num_warmup_steps=warmup_updates(total, ratio),
                              num_training_steps=total, scheduler_specific_kwargs={"min_lr_rate": floor})
    for k in range(total + 1):
        ours = cosine_with_min_lr_factor(k, warmup=warmup_updates(total, ratio), total=total, min_lr_ratio=floor)
        assert ours == pytest.approx(optimizer.param_groups[0]["lr"], rel=1e-12, abs=1e-15), k
        optimizer.step()
        reference.step()


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"lr_schedule": "cosine_with_min_lr"}, "total_updates: expected the run's number of updates with lr_schedule='cosine_with_min_lr'"),
        ({"lr_schedule": "linear"}, "lr_schedule: expected one of ('constant', 'cosine_with_min_lr')"),
        ({"lr_warmup_ratio": 0.03}, "lr_warmup_ratio: expected 0.0 with lr_schedule='constant'"),
        ({"min_lr_ratio": 0.1}, "min_lr_ratio: expected 0.0 with lr_schedule='constant'"),
        ({"lr_schedule": "cosine_with_min_lr", "total_updates": 10, "min_lr_ratio": 1.5}, "min_lr_ratio"),
        ({"total_updates": 0}, "total_updates: expected None or an integer >= 1"),
    ],
)
def test_schedule_settings_are_checked(overrides, needle):
    with pytest.raises(ValueError) as info:
        LearnerSpec(model="m", **overrides)
    assert needle in str(info.value)


def test_adamw_settings_and_one_group_that_decays_norms_and_biases():
    # One AdamW step with zero gradients moves only by the decoupled decay: p <- p (1 - lr * wd).
    # lr 0.5, wd 0.1: every parameter, the LayerNorm's weight and bias and the Linear's bias included,
    # goes from 1.0 to 0.95 (Molt decays every parameter: one group).
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0)
    spec = LearnerSpec(model="m", lr=0.5, betas=(0.9, 0.95), adam_eps=1e-6, weight_decay=0.1)
    optimizer = OPTIMIZERS["adamw"](model.parameters(), spec)
    assert len(optimizer.param_groups) == 1
    group = optimizer.param_groups[0]
    assert (group["betas"], group["eps"], group["weight_decay"]) == ((0.9, 0.95), 1e-6, 0.1)
    assert len(group["params"]) == 4
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), torch.full_like(p, 0.95), msg=name)


def test_learner_groups_every_parameter_once(make_spec):
    learner = Learner(make_spec(weight_decay=0.1, betas=(0.9, 0.95)))
    (group,) = learner.optimizer.param_groups
    assert len(group["params"]) == len([p for p in learner.model.parameters() if p.requires_grad])
    assert any(p.dim() == 1 for p in group["params"])  # the norms' weights decay too
    assert group["weight_decay"] == 0.1 and group["betas"] == (0.9, 0.95)


def test_learner_follows_the_schedule_and_a_restore_continues_it(make_spec, batch, next_batch, tmp_path):
    # N = 4, warmup ceil(4 * 0.25) = 1, floor 0.1, lr 1e-3:
    #   k = 0: 0;  k = 1: 1e-3;  k = 2: progress 1/3 -> 0.1 + 0.9 * 0.75 = 0.775;  k = 3: progress 2/3 -> 0.325
    options = {"optimizer": "adamw", "lr": 1e-3, "lr_schedule": "cosine_with_min_lr", "total_updates": 4,
               "lr_warmup_ratio": 0.25, "min_lr_ratio": 0.1}
    batches = [batch, next_batch, batch, next_batch]
    straight = Learner(make_spec(**options))
    lrs = [straight.update(b)["lr"] for b in batches]
    assert lrs == pytest.approx([0.0, 1e-3, 7.75e-4, 3.25e-4], rel=1e-9, abs=1e-15)

    first = Learner(make_spec(**options))
    for b in batches[:2]:
        first.update(b)
    torch.save(first.get_state(), tmp_path / "state.pt")
    second = Learner(make_spec(**options))
    second.set_state(torch.load(tmp_path / "state.pt", weights_only=True))
    resumed = [second.update(b)["lr"] for b in batches[2:]]
    assert resumed == pytest.approx(lrs[2:], rel=1e-9, abs=1e-15)
    weights, expected = second.get_weights(), straight.get_weights()
    for name, value in expected.items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=0, msg=name)


def test_a_skipped_batch_does_not_advance_the_schedule(make_spec, batch):
    from dataclasses import replace

    learner = Learner(make_spec(lr=1e-3, lr_schedule="cosine_with_min_lr", total_updates=4, lr_warmup_ratio=0.5))
    bad = replace(batch, rewards=torch.full_like(batch.rewards, math.nan))
    assert learner.update(bad)["applied"] == 0.0
    assert learner.lr_scheduler.last_epoch == 0
    # W = 2: update 0 has lr 0, update 1 has 1/2 of it.
    assert [learner.update(batch)["lr"] for _ in range(2)] == pytest.approx([0.0, 5e-4], abs=1e-15)


def test_a_state_without_a_scheduler_resumes_the_schedule_at_its_version(make_spec, batch, next_batch):
    options = {"lr": 1e-3, "lr_schedule": "cosine_with_min_lr", "total_updates": 4, "lr_warmup_ratio": 0.25,
               "min_lr_ratio": 0.1}
    first = Learner(make_spec(**options))
    first.update(batch)
    first.update(next_batch)
    state = first.get_state()
    del state["lr_scheduler"]  # as saved before the learner had a schedule
    second = Learner(make_spec(**options))
    second.set_state(state)
    assert second.lr_scheduler.last_epoch == 2
    assert second.update(batch)["lr"] == pytest.approx(7.75e-4, rel=1e-9)  # update 2 of the schedule


def test_the_filter_without_success_labels_is_an_error_with_the_fix(make_spec, batch):
    from dataclasses import replace

    learner = Learner(make_spec(negative_token_fraction=0.5))
    with pytest.raises(ValueError, match=r"no success labels .* info\['success'\]"):
        learner.update(replace(batch, success=None))
    assert learner.version == 0
