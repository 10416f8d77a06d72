"""LearnerSpec: validation, the optimizer registry, dict round-trip (the loss object included)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flashrl.learners import OPTIMIZERS, LearnerSpec, register_optimizer


def test_every_field_has_a_one_line_docstring():
    import ast
    import inspect

    from flashrl.learners import spec as module

    tree = ast.parse(inspect.getsource(module))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LearnerSpec")
    documented = set()
    for node, after in zip(cls.body, cls.body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            documented.add(node.target.id)
    assert documented == {f.name for f in dataclasses.fields(LearnerSpec)}


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"dtype": "float16"}, "dtype"),
        ({"weight_sync_dtype": "float16"}, "weight_sync_dtype"),
        ({"dtype": "float64", "weight_sync_dtype": "float32"}, "weight_sync_dtype"),
        ({"optimizer": "lion"}, "optimizer"),
        ({"lr": 0.0}, "lr"),
        ({"lr": float("nan")}, "lr"),
        ({"betas": (0.9, 1.0)}, "betas"),
        ({"weight_decay": -1.0}, "weight_decay"),
        ({"grad_clip": 0.0}, "grad_clip"),
        ({"temperature": 0.0}, "temperature"),
        ({"logprob_chunk_size": 0}, "logprob_chunk_size"),
        ({"device": "tpu"}, "device"),
        ({"max_tokens_per_micro_batch": 0}, "max_tokens_per_micro_batch"),
        ({"loss": "flash_reinforce"}, "loss"),
    ],
)
def test_rejects_impossible_settings_naming_field_expected_and_actual(overrides, field):
    with pytest.raises(ValueError, match=rf"Invalid LearnerSpec:(\n  - .*)*\n  - {field}: expected .+, got "):
        LearnerSpec(model="some/model", **overrides)


def test_dict_round_trip_and_unknown_keys():
    from flashrl.algorithms.flash_reinforce.learner_loss import FlashReinforceLossSpec

    loss = FlashReinforceLossSpec(negative_token_fraction=0.2, delta=float("inf"), importance_sampling="none",
                              aggregation="constant_length", constant_length_normalizer=6144)
    spec = LearnerSpec(model="m", lr=3e-6, betas=[0.8, 0.9], grad_clip=None, lr_schedule="cosine_with_min_lr",
                       total_updates=100, lr_warmup_ratio=0.03, min_lr_ratio=0.1, max_tokens_per_micro_batch=4096,
                       pack_sequences=True, loss=loss)
    assert spec.betas == (0.8, 0.9)
    data = spec.to_dict()
    assert data["loss"]["type"] == "flashrl.algorithms.flash_reinforce.learner_loss:FlashReinforceLossSpec"
    assert LearnerSpec.from_dict(data) == spec
    with pytest.raises(ValueError, match=r"LearnerSpec\.loss: expected a dict with a 'type'"):
        LearnerSpec.from_dict({**data, "loss": {"delta": 0.1}})
    with pytest.raises(ValueError, match="Unknown LearnerSpec fields \\['learning_rate'\\]"):
        LearnerSpec.from_dict({"model": "m", "learning_rate": 1.0})


def test_optimizer_registry_builds_what_the_spec_names():
    params = [torch.nn.Parameter(torch.zeros(3))]
    adamw = OPTIMIZERS["adamw"](params, LearnerSpec(model="m", lr=0.5, betas=(0.8, 0.95), weight_decay=0.1))
    assert isinstance(adamw, torch.optim.AdamW)
    group = adamw.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (0.5, (0.8, 0.95), 0.1)
    sgd = OPTIMIZERS["sgd"](params, LearnerSpec(model="m", optimizer="sgd", lr=0.25))
    assert isinstance(sgd, torch.optim.SGD) and sgd.param_groups[0]["lr"] == 0.25
    with pytest.raises(ValueError, match="already registered"):
        register_optimizer("sgd")(lambda params, spec: torch.optim.SGD(params, lr=spec.lr))
