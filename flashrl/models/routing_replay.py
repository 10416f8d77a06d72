"""Routing replay (R3) for mixture-of-experts policies: train with the experts the engine routed to.

An MoE layer's router picks each token's top-k experts. The inference engine routes with the
weights it was last sent and its own kernels; the learner routes with its current weights. Where
the two pick different experts, the learner's log-prob of a token is that of another computation
than the one the engine sampled from, and the importance ratio and the trust region measure the
routing flip instead of the policy change. Routing replay ("rollout routing replay", R3; Molt's
``--train.routing_replay``, molt-rl 0.2.1 ``molt/models/base.py``) removes that: the engine returns
the experts it routed every token to, the episode carries them, and the learner's forward uses
those experts while recomputing their gate weights from its own router logits, so the router still
gets a gradient.

Layout: ``routed_experts`` is an integer array ``[tokens, num_hidden_layers, top_k]``, row ``t``
the experts token ``t`` was routed to (as an input of the model) in every decoder layer, which is
how vLLM returns it (``CompletionOutput.routed_experts``, layers by global decoder-layer id). Rows
of ``NO_ROUTING`` (-1) were not recorded: the learner routes those tokens itself. That is the case
for the last token of an episode (the engine never feeds the token it sampled last), for env
tokens after the last model turn, and for the columns of dense layers (``mlp_only_layers``); none
of them changes a trained log-prob except a dense layer, which has no router to replay.

The replay (:func:`replay_routing`) patches no code: it hooks the output of each router module
(transformers' ``Qwen3MoeTopKRouter``, ``Qwen2MoeTopKRouter``, ``MixtralTopKRouter``: they return
``(router_logits, top_k_weights, top_k_index)``). The hook keeps the logits, takes the replayed
indices, and recomputes the weights exactly as the router does for its own choice: softmax over
all experts in float32, gathered at the replayed indices, renormalised over the k when the router
normalises (``norm_topk_prob``; Mixtral always does). :func:`record_routing` hooks the same modules
to record the live choice (the torch engine records with it).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "NO_ROUTING",
    "ROUTER_CLASSES",
    "RoutingRecorder",
    "check_routing",
    "moe_routing_shape",
    "record_routing",
    "replay_routing",
    "router_modules",
    "routing_replay_problem",
]

NO_ROUTING = -1
"""Expert id of a position without recorded routing: the learner keeps its own choice there."""

ROUTER_CLASSES: dict[str, bool | None] = {
    "Qwen3MoeTopKRouter": None,  # None: the router's own ``norm_topk_prob`` decides
    "Qwen2MoeTopKRouter": None,
    "MixtralTopKRouter": True,  # always renormalises its top-k weights
}
"""transformers router classes whose routing can be recorded and replayed (softmax top-k routers)."""

_EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


@dataclass(frozen=True)
class _Router:
    layer: int
    """Global decoder-layer index (the column of ``routed_experts``)."""
    module: torch.nn.Module
    top_k: int
    normalize: bool


def moe_routing_shape(config: Any) -> tuple[int, int, int] | None:
    """``(num_hidden_layers, top_k, num_experts)`` of an MoE model's config (HF object or dict), else None."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    text = get("text_config", None)
    if text is not None and get("num_hidden_layers", None) is None:
        return moe_routing_shape(text)
    experts = next((int(v) for f in _EXPERT_COUNT_FIELDS if isinstance(v := get(f, None), int) and v > 0), None)
    top_k = get("num_experts_per_tok", None)
    layers = get("num_hidden_layers", None)
    if experts is None or not isinstance(top_k, int) or top_k < 1 or not isinstance(layers, int):
        return None
    return layers, top_k, experts


def routing_replay_problem(model: str) -> str | None:
    """Why ``model`` (a spec for ``resolve_model``) cannot replay routing, or None (MoE, or not known yet).

    A local folder is read from its ``config.json``; flashrl's built-in models are dense. A hub id
    that is not a local folder is checked when the learner loads it (:func:`router_modules`).
    """
    from flashrl.models.resolve import BUILTIN_MODELS

    if isinstance(model, str) and model.lower() in BUILTIN_MODELS:
        return f"{model!r} is a dense model (no MoE router)"
    path = Path(os.fspath(model)) / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        return f"cannot read {path}: {err}"
    if moe_routing_shape(config) is None:
        return f"{model!r} is a dense model (model_type {config.get('model_type')!r}: no MoE router)"
    return None


def router_modules(model: torch.nn.Module) -> list[_Router]:
    """The MoE routers of ``model`` with their decoder-layer index, in layer order.

    Raises ``ValueError`` for a model without routers (a dense model) or with a router class whose
    routing cannot be replayed (not in ``ROUTER_CLASSES``).
    """
    routers: list[_Router] = []
    unsupported: set[str] = set()
    for name, module in model.named_modules():
        kind = type(module).__name__
        if kind not in ROUTER_CLASSES:
            if "router" in kind.lower() and "Router" in kind:
                unsupported.add(kind)
            continue
        match = _LAYER.search(name)
        if match is None:
            raise ValueError(f"routing replay: cannot tell the decoder layer of the router {name!r} ({kind}).")
        fixed = ROUTER_CLASSES[kind]
        normalize = bool(getattr(module, "norm_topk_prob", True)) if fixed is None else fixed
        routers.append(_Router(int(match.group(1)), module, int(module.top_k), normalize))
    if unsupported:
        raise ValueError(
            f"routing replay supports the softmax top-k routers {sorted(ROUTER_CLASSES)}; this model has "
            f"{sorted(unsupported)}. Fix: set routing_replay=False (or freeze_moe_router=True) for it."
        )
    if not routers:
        kind = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise ValueError(
            f"routing replay: expected a mixture-of-experts model with router modules; {kind!r} has none. "
            "Fix: set routing_replay=False for a dense model."
        )
    return sorted(routers, key=lambda r: r.layer)


def check_routing(routed: torch.Tensor, model: torch.nn.Module) -> None:
    """Raise ``ValueError`` unless ``routed`` [..., num_hidden_layers, top_k] fits ``model``'s routers.

    Reads the values on the host: call it once per batch on its host copy, not per micro-batch.
    """
    shape = moe_routing_shape(model.config)
    if shape is None:
        raise ValueError("routing replay: the model's config names no experts (num_experts, num_experts_per_tok).")
    layers, top_k, experts = shape
    if routed.dim() < 2 or tuple(routed.shape[-2:]) != (layers, top_k):
        raise ValueError(
            f"routed_experts: expected [..., {layers}, {top_k}] (num_hidden_layers, num_experts_per_tok of the "
            f"policy), got shape {tuple(routed.shape)}. Fix: record the routing with the model being trained."
        )
    if routed.numel() and (int(routed.min()) < NO_ROUTING or int(routed.max()) >= experts):
        raise ValueError(
            f"routed_experts: expected expert ids in [0, {experts}) or {NO_ROUTING} (not recorded), got values "
            f"in [{int(routed.min())}, {int(routed.max())}]."
        )


@contextmanager
def replay_routing(model: torch.nn.Module, routed: torch.Tensor) -> Iterator[None]:
    """Every forward of ``model`` inside the block routes its tokens to ``routed`` [N, layers, top_k].

    ``N`` is the number of tokens of each forward, in the order the model flattens them (row-major
    over ``input_ids``: ``[B, T]`` padded rows give ``B * T``, a packed ``[1, N]`` row ``N``). A row
    with a ``NO_ROUTING`` entry keeps the router's own choice. Keep the block open through the
    backward pass when activations are recomputed (gradient checkpointing runs the routers again).
    """
    routers = router_modules(model)
    handles = [r.module.register_forward_hook(_replay_hook(r, routed)) for r in routers]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _replay_hook(router: _Router, routed: torch.Tensor) -> Any:
    def hook(module: torch.nn.Module, args: Any, output: Any) -> Any:
        logits, weights, live = output  # [N, E], [N, k], [N, k]
        if routed.shape[0] != live.shape[0] or routed.shape[1] <= router.layer or routed.shape[2] != live.shape[1]:
            raise ValueError(
                f"routing replay: layer {router.layer}'s router sees {live.shape[0]} tokens x top-{live.shape[1]}; "
                f"the replayed routing is {tuple(routed.shape)} (tokens, layers, top_k)."
            )
        target = routed[:, router.layer].to(device=live.device, dtype=live.dtype)  # [N, k]
        keep = (target < 0).any(-1, keepdim=True)  # [N, 1] not recorded: the live choice
        indices = torch.where(keep, live, target)  # [N, k]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [N, E], as the router computes them
        top = probs.gather(-1, indices)  # [N, k]
        if router.normalize:
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top.to(weights.dtype), indices

    return hook


@dataclass
class RoutingRecorder:
    """The experts every router picked in the last forward of the model (see :func:`record_routing`)."""

    num_layers: int
    top_k: int
    _layers: dict[int, torch.Tensor] = field(default_factory=dict)

    def take(self) -> torch.Tensor:
        """``[N, num_layers, top_k]`` int16 (CPU) of the last forward, ``NO_ROUTING`` in dense layers; then cleared.

        Call it after every forward: a second forward before it overwrites the first.
        """
        if not self._layers:
            raise RuntimeError("RoutingRecorder.take(): no forward ran since the last take().")
        n = next(iter(self._layers.values())).shape[0]
        out = torch.full((n, self.num_layers, self.top_k), NO_ROUTING, dtype=torch.int16)
        for layer, indices in self._layers.items():
            out[:, layer] = indices
        self._layers = {}
        return out


@contextmanager
def record_routing(model: torch.nn.Module) -> Iterator[RoutingRecorder]:
    """Record the experts every router of ``model`` picks in each forward inside the block."""
    routers = router_modules(model)
    shape = moe_routing_shape(model.config)
    num_layers = shape[0] if shape is not None else max(r.layer for r in routers) + 1
    recorder = RoutingRecorder(num_layers=num_layers, top_k=routers[0].top_k)

    def hook_for(layer: int) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            recorder._layers[layer] = output[2].detach().to("cpu", torch.int16)  # [N, k]

        return hook

    handles = [r.module.register_forward_hook(hook_for(r.layer)) for r in routers]
    try:
        yield recorder
    finally:
        for handle in handles:
            handle.remove()
