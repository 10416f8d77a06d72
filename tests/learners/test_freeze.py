"""freeze_moe_router freezes exactly the routers of a tiny random Qwen3-MoE (and of Mixtral), never a dense MLP."""

from __future__ import annotations

import pytest
import torch

from flashrl.learners.freeze import freeze_moe_router


def _qwen3_moe(num_layers: int = 2) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=8,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    return Qwen3MoeForCausalLM(config)


def test_freezes_the_router_of_every_qwen3_moe_layer_and_nothing_else():
    model = _qwen3_moe(num_layers=2)
    frozen = freeze_moe_router(model)
    assert frozen == ["model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight"]
    still = {n for n, p in model.named_parameters() if p.requires_grad}
    assert still == {n for n, _ in model.named_parameters()} - set(frozen)
    assert any("experts" in n for n in still)  # the experts themselves still train


def test_a_step_leaves_the_router_unchanged_and_moves_the_experts():
    model = _qwen3_moe(num_layers=1)
    freeze_moe_router(model)
    router = model.model.layers[0].mlp.gate.weight.detach().clone()
    experts = [p.detach().clone() for n, p in model.named_parameters() if "experts" in n]
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(0))  # [B, T]
    model(input_ids=ids, labels=ids).loss.backward()
    assert model.model.layers[0].mlp.gate.weight.grad is None
    optimizer.step()
    assert torch.equal(model.model.layers[0].mlp.gate.weight, router)
    assert any(
        not torch.equal(p, q)
        for p, q in zip([p for n, p in model.named_parameters() if "experts" in n], experts)
    )


def test_mixtral_block_sparse_moe_gate():
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    frozen = freeze_moe_router(MixtralForCausalLM(config))
    assert len(frozen) == 1 and frozen[0].endswith(".gate.weight") and "gate_proj" not in frozen[0]


def test_a_dense_model_has_no_router_to_freeze():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    model = Qwen2ForCausalLM(config)
    with pytest.raises(ValueError, match="freeze_moe_router=False for a dense model"):
        freeze_moe_router(model)
    assert all(p.requires_grad for p in model.parameters())  # nothing frozen on the way to the error


def test_the_learner_keeps_a_frozen_router_out_of_the_optimizer_and_unchanged(tmp_path, episode_maker):
    from flashrl.algorithms.flash_reinforce.learner_loss import FlashReinforceLossSpec
    from flashrl.learners import Learner, LearnerSpec, TrainBatch

    path = tmp_path / "moe"
    _qwen3_moe(num_layers=2).save_pretrained(path)
    episodes = episode_maker(str(path), num=4, seed=3, rewards=[1.0, 0.0, 1.0, 0.0])
    spec = LearnerSpec(model=str(path), lr=1e-2, weight_decay=0.1, grad_clip=None, freeze_moe_router=True,
                       loss=FlashReinforceLossSpec(delta=float("inf")))
    learner = Learner(spec)
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    routers = [n for n in before if n.endswith("mlp.gate.weight")]
    assert len(routers) == 2
    assert all(not p.requires_grad for n, p in learner.model.named_parameters() if n in routers)
    metrics = learner.update(TrainBatch.from_episodes(episodes, pad_token_id=0))
    assert metrics["applied"] == 1.0
    after = dict(learner.model.named_parameters())
    for name in routers:  # no gradient, no weight decay: bit for bit the same
        torch.testing.assert_close(after[name].detach(), before[name], rtol=0, atol=0)
    assert any(not torch.equal(after[n].detach(), before[n]) for n in before if "experts" in n)


def test_the_learner_refuses_to_freeze_the_router_of_a_dense_model(tiny_llama_path):
    from flashrl.algorithms.flash_reinforce.learner_loss import FlashReinforceLossSpec
    from flashrl.learners import Learner, LearnerSpec

    spec = LearnerSpec(model=tiny_llama_path, freeze_moe_router=True, loss=FlashReinforceLossSpec(delta=0.01))
    with pytest.raises(ValueError, match="router"):
        Learner(spec)


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_sharded_learners_keep_a_frozen_router_unchanged(ray_cluster, tmp_path, episode_maker):
    """The same guarantee under FSDP2 (2 gloo ranks): the frozen router is sharded with the rest of its
    layer but takes no gradient and no decay, while the experts beside it train."""
    from transformers import AutoModelForCausalLM

    from flashrl.algorithms.flash_reinforce.learner_loss import FlashReinforceLossSpec
    from flashrl.learners import LearnerGroup, LearnerSpec, TrainBatch

    path = tmp_path / "moe"
    _qwen3_moe(num_layers=2).save_pretrained(path)
    before = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    episodes = episode_maker(str(path), num=4, seed=3, rewards=[1.0, 0.0, 1.0, 0.0])
    spec = LearnerSpec(model=str(path), lr=1e-2, weight_decay=0.1, grad_clip=None, freeze_moe_router=True,
                       device="cpu", loss=FlashReinforceLossSpec(delta=float("inf")))  # fmt: skip
    group = LearnerGroup(spec, num_learners=2, num_cpus_per_learner=0.5, timeout_s=240.0)
    try:
        metrics = group.update(TrainBatch.from_episodes(episodes, pad_token_id=0))
        after = group.get_weights()
        state = group.get_state()
    finally:
        group.shutdown()
    assert metrics["applied"] == 1.0
    routers = [n for n in before if n.endswith("mlp.gate.weight")]
    assert len(routers) == 2
    # the state names the optimizer's parameters: every trainable one, the frozen routers not
    assert set(state["optimizer"]["state"]) == set(state["model"]) - set(routers)
    for name in routers:  # bit for bit: no gradient, no weight decay
        torch.testing.assert_close(after[name], before[name], rtol=0, atol=0)
    assert any(not torch.equal(after[n], before[n]) for n in before if "experts" in n)
