"""Freezing the router of a mixture-of-experts policy during RL.

The router picks each token's experts. The inference engine routes with the weights it was last sent,
the learner with its current ones; a router that moves between updates routes some tokens to other
experts in the two, which adds to the drift the trust region measures. Freezing it keeps the
routing of engine and learner identical for the whole run (and drops the router from the optimizer
and from every weight sync's changes). Molt has the same option, ``--actor.freeze_moe_router``
(molt-rl 0.2.1, ``molt/models/base.py``): it freezes every parameter of each router module
(``isinstance(module, Gate)``, matched by type, not by the name ``gate``, which would also catch the
gated MLP's ``gate_proj``).
"""

from __future__ import annotations

import torch

__all__ = ["freeze_moe_router", "is_moe_router"]

_EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def is_moe_router(name: str, module: torch.nn.Module, num_experts: int | None) -> bool:
    """Whether ``module`` (at ``name``) is an MoE router of a Hugging Face model.

    Routers are recognised by type: transformers' router classes (``Qwen3MoeTopKRouter``,
    ``MixtralTopKRouter``, ``Qwen2MoeTopKRouter``, ``DeepseekV3TopkRouter``, ...), or, in models that
    route with a plain linear layer, a ``Linear`` called ``gate`` mapping to ``num_experts`` outputs
    (Mixtral's ``block_sparse_moe.gate``, Qwen-MoE's ``mlp.gate`` in older transformers). A gated
    MLP's ``gate_proj`` and Qwen2-MoE's one-output ``shared_expert_gate`` are not routers.
    """
    if "router" in type(module).__name__.lower():
        return True
    leaf = name.rsplit(".", 1)[-1]
    return (
        leaf == "gate"
        and isinstance(module, torch.nn.Linear)
        and num_experts is not None
        and module.out_features == num_experts
    )


def freeze_moe_router(model: torch.nn.Module) -> list[str]:
    """Set ``requires_grad=False`` on every MoE router parameter of ``model``; returns their names.

    Call it before the optimizer is built (parameters without gradients then stay out of it). Raises
    ``ValueError`` for a model without a router (a dense model: nothing to freeze is a configuration
    mistake, not a no-op).
    """
    config = getattr(model, "config", None)
    num_experts = next(
        (int(v) for f in _EXPERT_COUNT_FIELDS if isinstance(v := getattr(config, f, None), int) and v > 0),
        None,
    )
    frozen: list[str] = []
    for name, module in model.named_modules():
        if not is_moe_router(name, module, num_experts):
            continue
        for param_name, param in module.named_parameters(recurse=False):
            param.requires_grad_(False)
            frozen.append(f"{name}.{param_name}" if name else param_name)
    if not frozen:
        kind = getattr(config, "model_type", type(model).__name__)
        raise ValueError(
            f"freeze_moe_router: expected a mixture-of-experts model with router (gate) modules; "
            f"{kind!r} has none. Set freeze_moe_router=False for a dense model."
        )
    return frozen
