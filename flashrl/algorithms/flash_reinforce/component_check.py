"""Each loss component called once on a small synthetic batch, so a wrong return fails at ``validate()``.

`Registry.problem` checks a component's signature only: a baseline that returns a scalar instead of
one advantage per trajectory passes it and would fail deep inside the first update (an
``IndexError`` in the learner that names no component). Here every component of the loss is called
as the loss calls it, on B = 2 trajectories of T = 3 tokens, and what it returns is compared with
what the loss needs (type, shape, dtype); a problem names the component, the expected and the
actual return.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from flashrl.algorithms.flash_reinforce.components import Normalizers

B, T = 2, 3
"""The synthetic batch: B trajectories of T tokens."""


def _batch() -> dict[str, torch.Tensor]:
    logprobs = torch.tensor([[-0.5, -1.0, -2.0], [-0.1, -0.7, -1.5]])  # [B, T]
    return {
        "rewards": torch.tensor([1.0, 0.0]),  # [B]
        "group_ids": torch.tensor([0, 0]),  # [B]  one group of two
        "logprobs": logprobs,
        "behavior_logprobs": logprobs - 0.05,  # [B, T]
        "loss_mask": torch.tensor([[True, True, False], [True, True, True]]),  # [B, T]
        "entropy": torch.tensor([[0.3, 0.9, 0.0], [0.5, 0.2, 0.8]]),  # [B, T]
        "failures": torch.tensor([False, True]),  # [B]
    }


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def _tensor_problem(value: Any, shape: list[int], *, boolean: bool = False) -> bool:
    if not isinstance(value, torch.Tensor) or list(value.shape) != shape:
        return True
    return value.dtype != torch.bool if boolean else not value.is_floating_point()


def _checks(loss: Any, x: dict[str, torch.Tensor]) -> dict[str, tuple[Callable[[Any], Any], Callable[[Any], bool], str]]:
    """Per component: how the loss calls it, whether a return is wrong, what it must return."""
    norm = Normalizers(num_trajectories=B, num_tokens=int(x["loss_mask"].sum()),
                       constant_length=loss.constant_length_normalizer)
    return {
        "baseline": (
            lambda c: c(x["rewards"], group_ids=x["group_ids"]),
            lambda out: _tensor_problem(out, [B]),
            f"a float tensor of advantages of shape [B] = [{B}] for rewards of shape [{B}] (one per trajectory)",
        ),
        "importance_sampling": (
            lambda c: c(x["logprobs"], x["behavior_logprobs"]),
            lambda out: _tensor_problem(out, [B, T]),
            f"a float tensor of shape [B, T] = [{B}, {T}] (one term per token)",
        ),
        "trust_region": (
            lambda c: c(x["logprobs"], x["behavior_logprobs"], x["loss_mask"], delta=loss.delta),
            lambda out: _tensor_problem(getattr(out, "drift", None), [B])
            or _tensor_problem(getattr(out, "trust_mask", None), [B], boolean=True),
            (f"a TrustDecision with drift, a float tensor of shape [B] = [{B}], and trust_mask, a bool tensor "
             f"of shape [{B}]"),
        ),
        "aggregation": (
            lambda c: c(x["logprobs"] * x["loss_mask"], x["loss_mask"].sum(-1), norm),
            lambda out: _tensor_problem(out, []),
            "a float tensor of shape [] (the loss: a scalar tensor, so it can be back-propagated)",
        ),
        "token_mask": (
            lambda c: c(x["loss_mask"], entropy=x["entropy"], failures=x["failures"]),
            lambda out: _tensor_problem(out, [B, T], boolean=True),
            f"a bool tensor of shape [B, T] = [{B}, {T}] (a subset of loss_mask)",
        ),
    }


def component_call_problems(loss: Any) -> list[str]:
    """Every loss component (`FlashReinforceLossSpec.component`) called once on the synthetic batch: its problems."""
    x = _batch()
    problems = []
    for name, (call, wrong, expected) in _checks(loss, x).items():
        component = loss.component(name)
        if component is None:
            continue  # token_mask unset: the loss's own filter
        setting = getattr(loss, name, None)
        where = f"{name} ({setting!r})" if isinstance(setting, str) else name
        try:
            out = call(component)
        except Exception as err:  # noqa: BLE001 - the user's component: its error, named
            problems.append(f"{where}: expected {expected} when called on a synthetic batch (B = {B}, T = {T}), got "
                            f"{type(err).__name__}: {err}. Fix: see the {name} protocol in "
                            "flashrl.algorithms.flash_reinforce.components")
            continue
        if wrong(out):
            problems.append(f"{where}: expected {expected} when called on a synthetic batch (B = {B}, T = {T}), got "
                            f"{_describe(out)}. Fix: return that (the {name} protocol is in "
                            "flashrl.algorithms.flash_reinforce.components)")
        elif isinstance(out, torch.Tensor) and out.is_floating_point() and not torch.isfinite(out).all():
            problems.append(f"{where}: expected finite values on a synthetic batch (B = {B}, T = {T}), got "
                            f"{out.tolist()}. Fix: guard the component's divisions and logs")
    return problems


__all__ = ["component_call_problems"]
