"""Routing replay (R3) on a tiny Qwen3-MoE: the replayed forward uses the recorded experts, gates recomputed."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from flashrl.models.routing_replay import (
    NO_ROUTING,
    check_routing,
    moe_routing_shape,
    record_routing,
    replay_routing,
    router_modules,
    routing_replay_problem,
)


@pytest.fixture
def moe(tiny_qwen3_moe_path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_qwen3_moe_path, dtype=torch.float32).eval()


@contextlib.contextmanager
def experts_inputs(model: torch.nn.Module) -> Iterator[dict[int, list[tuple[torch.Tensor, torch.Tensor]]]]:
    """What each layer's experts were called with: ``{layer: [(top_k_index [N, k], top_k_weights [N, k])]}``.

    The experts module's inputs are what the layer computes with, whatever a router hook did before.
    """
    seen: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    handles = []
    for i, layer in enumerate(model.model.layers):
        def hook(module, args, i=i):
            seen.setdefault(i, []).append((args[1].detach().clone(), args[2].detach().clone()))

        handles.append(layer.mlp.experts.register_forward_pre_hook(hook))
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def router_inputs(model: torch.nn.Module) -> Iterator[dict[int, torch.Tensor]]:
    seen: dict[int, torch.Tensor] = {}
    handles = []
    for i, layer in enumerate(model.model.layers):
        def hook(module, args, i=i):
            seen[i] = args[0].detach().clone()

        handles.append(layer.mlp.gate.register_forward_pre_hook(hook))
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def _move_routers(model: torch.nn.Module, scale: float = 1.0, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            w = layer.mlp.gate.weight
            w.add_(torch.randn(w.shape, generator=gen) * scale * w.std())


def test_replay_routes_every_token_to_the_recorded_experts_after_the_router_moved(moe: torch.nn.Module) -> None:
    ids = torch.randint(1, moe.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))  # [B, T]
    with torch.no_grad(), record_routing(moe) as recorder:
        moe(ids)
        recorded = recorder.take()  # [B*T, layers, k]
    layers, k, experts = moe_routing_shape(moe.config)
    assert recorded.shape == (24, layers, k) and recorded.dtype == torch.int16
    _move_routers(moe)  # the learner's router after some updates
    with torch.no_grad(), experts_inputs(moe) as live:
        moe(ids)
    changed = [(live[i][0][0].sort(-1).values != recorded[:, i].long().sort(-1).values).any(-1) for i in range(layers)]
    assert float(torch.stack(changed).float().mean()) > 0.3  # unreplayed, the moved router picks other experts

    with torch.no_grad(), replay_routing(moe, recorded), experts_inputs(moe) as used, router_inputs(moe) as hidden:
        moe(ids)
    for i in range(layers):
        (index, weights), = used[i]
        assert torch.equal(index, recorded[:, i].long())  # every token, every layer: the recorded experts
        # the gates: the CURRENT router's softmax over all experts at the replayed experts, renormalised
        probs = torch.softmax(hidden[i] @ moe.model.layers[i].mlp.gate.weight.T, dim=-1)  # [N, E]
        top = probs.gather(-1, index)
        torch.testing.assert_close(weights, top / top.sum(-1, keepdim=True), rtol=1e-6, atol=1e-7)
    assert experts == 8 and k == 2


def test_rows_without_recorded_routing_keep_the_routers_choice(moe: torch.nn.Module) -> None:
    ids = torch.randint(1, moe.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(1))
    forced = torch.tensor([[5, 7], [0, 3]], dtype=torch.int16)  # layer 0, layer 1 of every token
    routed = forced.expand(6, 2, 2).clone()
    routed[2] = NO_ROUTING  # not recorded (like an episode's last token)
    with torch.no_grad(), replay_routing(moe, routed), experts_inputs(moe) as used, router_inputs(moe) as hidden:
        moe(ids)
    for i in range(2):
        index = used[i][0][0]
        own = torch.topk(hidden[i][2] @ moe.model.layers[i].mlp.gate.weight.T, 2).indices  # the router's choice
        assert torch.equal(index[2], own)
        assert torch.equal(index[[0, 1, 3, 4, 5]], forced[i].long().expand(5, 2))


def test_replayed_gates_train_the_router(moe: torch.nn.Module) -> None:
    ids = torch.randint(1, moe.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(2))
    routed = torch.zeros(8, 2, 2, dtype=torch.int16)
    routed[:, :, 1] = 1  # experts 0 and 1 everywhere: what the router alone would hardly pick
    with replay_routing(moe, routed):
        moe(ids).logits.logsumexp(-1).sum().backward()
    for layer in moe.model.layers:
        grad = layer.mlp.gate.weight.grad  # [E, H]
        assert grad is not None and bool(grad[:2].abs().sum() > 0)
        assert bool(grad[2:].abs().sum() > 0)  # the softmax over all experts couples the others' logits too
    assert all(h.mlp.gate._forward_hooks == {} for h in moe.model.layers)  # the hooks are gone after the block


def test_replay_checks_the_token_count(moe: torch.nn.Module) -> None:
    with pytest.raises(ValueError, match="sees 5 tokens"), replay_routing(moe, torch.zeros(4, 2, 2, dtype=torch.int16)):
        moe(torch.ones(1, 5, dtype=torch.long))


def test_dense_models_are_refused(tiny_llama_path: str, tiny_qwen3_moe_path: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(tiny_llama_path)
    with pytest.raises(ValueError, match="'llama' has none. Fix: set routing_replay=False"):
        router_modules(dense)
    assert "dense model" in routing_replay_problem(tiny_llama_path)
    assert "dense model" in routing_replay_problem("smollm2-135m-instruct")
    assert routing_replay_problem(tiny_qwen3_moe_path) is None
    assert routing_replay_problem("Qwen/Qwen3-30B-A3B") is None  # a hub id: checked once loaded
    with open(Path(tiny_qwen3_moe_path) / "config.json") as f:
        config = json.load(f)
    assert moe_routing_shape(config) == (2, 2, 8)
    assert moe_routing_shape({**config, "text_config": None}) == (2, 2, 8)


def test_check_routing_names_the_expected_shape_and_ids(moe: torch.nn.Module) -> None:
    check_routing(torch.full((3, 5, 2, 2), NO_ROUTING, dtype=torch.int16), moe)
    with pytest.raises(ValueError, match=r"expected \[\.\.\., 2, 2\]"):
        check_routing(torch.zeros(3, 5, 2, 8, dtype=torch.int16), moe)
    with pytest.raises(ValueError, match=r"expert ids in \[0, 8\)"):
        check_routing(torch.full((3, 2, 2), 8, dtype=torch.int16), moe)
