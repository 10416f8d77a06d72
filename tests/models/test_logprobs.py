"""Learner-side log-probs: chunked recomputation equals a naive full log-softmax, padding-invariant."""

from __future__ import annotations

import pytest
import torch

from flashrl.models import compute_token_logprobs


@pytest.fixture(scope="module")
def tiny_model(tiny_llama_path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()


def _naive(
    model: torch.nn.Module, ids: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(input_ids=ids).logits[:, :-1].float() / temperature  # [B, T-1, V]
    logp = logits.log_softmax(-1)  # [B, T-1, V]
    token = logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # [B, T-1]
    entropy = -(logp.exp() * logp).sum(-1)  # [B, T-1]
    return torch.nn.functional.pad(token, (1, 0)), torch.nn.functional.pad(entropy, (1, 0))


def _ids(seed: int, b: int, t: int) -> torch.Tensor:
    return torch.randint(3, 49152, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_naive_log_softmax(tiny_model: torch.nn.Module, temperature: float) -> None:
    ids = _ids(0, 3, 12)
    with torch.no_grad():
        lp, ent = compute_token_logprobs(
            tiny_model, ids, torch.ones_like(ids), temperature=temperature, chunk_size=5
        )
        ref_lp, ref_ent = _naive(tiny_model, ids, temperature)
    assert lp.shape == ent.shape == (3, 12)
    assert torch.all(lp[:, 0] == 0) and torch.all(ent[:, 0] == 0)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=5e-5)  # H = lse - E[z]: float32 cancellation


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_changes_nothing_and_scores_zero(tiny_model: torch.nn.Module, side: str) -> None:
    a, b = _ids(1, 1, 9), _ids(2, 1, 5)
    pad = torch.zeros((1, 4), dtype=torch.long)
    b_padded = torch.cat([pad, b], 1) if side == "left" else torch.cat([b, pad], 1)
    mask_b = (
        torch.cat([pad, torch.ones_like(b)], 1) if side == "left" else torch.cat([torch.ones_like(b), pad], 1)
    )
    ids = torch.cat([a, b_padded])  # [2, 9]
    mask = torch.cat([torch.ones_like(a), mask_b])  # [2, 9]
    with torch.no_grad():
        lp, ent = compute_token_logprobs(tiny_model, ids, mask)
        alone, _ = compute_token_logprobs(tiny_model, b, torch.ones_like(b))
    real = mask_b[0].bool()
    torch.testing.assert_close(lp[1, real], alone[0], rtol=1e-5, atol=1e-5)
    assert torch.all(lp[1, ~real] == 0) and torch.all(ent[1, ~real] == 0)


def test_gradients_reach_the_parameters(tiny_model: torch.nn.Module) -> None:
    ids = _ids(3, 2, 6)
    lp, ent = compute_token_logprobs(tiny_model, ids, torch.ones_like(ids))
    (lp.sum() + ent.sum()).backward()
    head = tiny_model.get_output_embeddings().weight
    assert head.grad is not None and head.grad.abs().sum() > 0
    layer0 = tiny_model.model.layers[0].self_attn.q_proj.weight
    assert layer0.grad is not None and layer0.grad.abs().sum() > 0
    tiny_model.zero_grad(set_to_none=True)


def test_without_entropy_returns_none(tiny_model: torch.nn.Module) -> None:
    ids = _ids(4, 1, 4)
    with torch.no_grad():
        lp, ent = compute_token_logprobs(tiny_model, ids, torch.ones_like(ids), with_entropy=False)
    assert ent is None and lp.shape == (1, 4)


def test_shape_mismatch_is_an_error(tiny_model: torch.nn.Module) -> None:
    ids = _ids(5, 2, 4)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        compute_token_logprobs(tiny_model, ids, torch.ones((2, 5), dtype=torch.long))
