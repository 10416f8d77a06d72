"""The chunked log-prob/entropy kernel against a naive float64 log_softmax, values and gradients."""

from __future__ import annotations

import pytest
import torch

from flashrl.ops import logprobs as logprobs_module
from flashrl.ops.logprobs import chunked_token_logprobs, token_logprobs_from_logits


@pytest.fixture(params=["cpu", "cuda_eager", "cuda_compiled"])
def kernel(request, monkeypatch):
    """The op as each device runs it, all on CPU: `cpu` (float32 backward products, the eager in-place
    kernel); `cuda_eager` (products in the inputs' dtype, as with FLASHRL_COMPILE_LOGPROBS=0 on a GPU);
    `cuda_compiled` (that, and the pure chunk functions a GPU runs through torch.compile, here
    uncompiled: `_compile` is the identity)."""
    monkeypatch.setattr(logprobs_module, "_compiled", {})
    monkeypatch.setattr(logprobs_module, "_compile_error", [])
    if request.param != "cpu":
        monkeypatch.setattr(logprobs_module, "_product_dtype", lambda hidden, stats_dtype: hidden.dtype)
    if request.param == "cuda_compiled":
        monkeypatch.setattr(logprobs_module, "_use_fused", lambda x: not logprobs_module._compile_error)
        monkeypatch.setattr(logprobs_module, "_compile", lambda fn: fn)
    return request.param


def _naive(hidden, weight, bias, targets, temperature):
    logits = (hidden @ weight.T + (0 if bias is None else bias)) / temperature
    logp = torch.log_softmax(logits, -1)
    lp = logp.gather(-1, targets[:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


def _inputs(n=37, h=8, v=53, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=dtype)
    weight = torch.randn(v, h, generator=g, dtype=dtype)
    bias = torch.randn(v, generator=g, dtype=dtype)
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, bias, targets


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("use_bias", [False, True])
def test_linear_values_and_gradients_match_naive(chunk_size, temperature, use_bias, kernel):
    hidden, weight, bias, targets = _inputs()
    bias = bias if use_bias else None
    gl, ge = torch.randn(37, dtype=torch.float64), torch.randn(37, dtype=torch.float64)

    leaves = [x.clone().requires_grad_() for x in (hidden, weight)] + ([bias.clone().requires_grad_()] if use_bias else [])
    out = chunked_token_logprobs(
        leaves[0], leaves[1], targets, bias=leaves[2] if use_bias else None, temperature=temperature, chunk_size=chunk_size
    )
    ((out.logprobs.double() * gl).sum() + (out.entropy.double() * ge).sum()).backward()

    ref_leaves = [x.clone().requires_grad_() for x in (hidden, weight)] + ([bias.clone().requires_grad_()] if use_bias else [])
    lp, ent = _naive(ref_leaves[0], ref_leaves[1], ref_leaves[2] if use_bias else None, targets, temperature)
    ((lp * gl).sum() + (ent * ge).sum()).backward()

    assert out.logprobs.dtype == torch.float64  # float64 in, float64 out
    torch.testing.assert_close(out.logprobs, lp.detach(), rtol=0, atol=1e-10)
    torch.testing.assert_close(out.entropy, ent.detach(), rtol=0, atol=1e-10)
    for ours, ref in zip(leaves, ref_leaves):
        torch.testing.assert_close(ours.grad, ref.grad, rtol=0, atol=1e-10)


def test_without_entropy(kernel):
    hidden, weight, _, targets = _inputs(dtype=torch.float32)
    h = hidden.clone().requires_grad_()
    out = chunked_token_logprobs(h, weight, targets, chunk_size=7, with_entropy=False)
    assert out.entropy is None and out.logprobs.dtype == torch.float32
    out.logprobs.sum().backward()
    h2 = hidden.clone().requires_grad_()
    _naive(h2, weight, None, targets, 1.0)[0].sum().backward()
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk_size", [3, 100])
def test_from_logits_matches_naive(chunk_size):
    hidden, weight, _, targets = _inputs()
    logits = (hidden @ weight.T).requires_grad_()
    out = token_logprobs_from_logits(logits, targets, temperature=1.3, chunk_size=chunk_size)
    (out.logprobs.sum() + 0.5 * out.entropy.sum()).backward()
    logits2 = (hidden @ weight.T).requires_grad_()
    logp = torch.log_softmax(logits2 / 1.3, -1)
    lp = logp.gather(-1, targets[:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    (lp.sum() + 0.5 * ent.sum()).backward()
    torch.testing.assert_close(out.logprobs, lp.detach(), rtol=0, atol=1e-10)
    torch.testing.assert_close(logits.grad, logits2.grad, rtol=0, atol=1e-10)


def test_bfloat16_hidden_gives_float32_outputs_close_to_float32():
    hidden, weight, _, targets = _inputs(dtype=torch.float32)
    out16 = chunked_token_logprobs(hidden.bfloat16(), weight.bfloat16(), targets, chunk_size=8)
    out32 = chunked_token_logprobs(hidden.bfloat16().float(), weight.bfloat16().float(), targets, chunk_size=8)
    assert out16.logprobs.dtype == torch.float32
    # bf16 matmul output rounding: about 3 significant digits of the logits
    torch.testing.assert_close(out16.logprobs, out32.logprobs, rtol=0, atol=0.15)


@pytest.mark.parametrize("use_bias", [False, True])
def test_bfloat16_gradients_are_close_to_float64_and_come_back_in_the_inputs_dtypes(use_bias, kernel):
    # On CUDA the backward's products run in bfloat16 for bfloat16 inputs (as autograd of F.linear does),
    # on CPU in float32; the weight gradient is summed over chunks in float32 either way. Measured here
    # with bfloat16 products: relative errors 0.006-0.009 (the bfloat16 logits of the forward
    # dominate); summing the 512 one-row chunks in bfloat16 instead gave 0.011-0.013 for the weight
    # gradient, which the bound catches.
    hidden, weight, bias, targets = _inputs(n=512, h=16, v=97, dtype=torch.float64)
    bias = bias if use_bias else None
    g = torch.Generator().manual_seed(1)
    gl, ge = torch.randn(512, generator=g, dtype=torch.float64), torch.randn(512, generator=g, dtype=torch.float64)

    def grads(dtype, chunk_size):
        leaves = [x.detach().to(dtype).clone().requires_grad_() for x in (hidden, weight)]
        b = None if bias is None else bias.detach().to(dtype).clone().requires_grad_()
        out = chunked_token_logprobs(leaves[0], leaves[1], targets, bias=b, temperature=0.8, chunk_size=chunk_size)
        ((out.logprobs.double() * gl).sum() + (out.entropy.double() * ge).sum()).backward()
        return [x.grad for x in leaves] + ([] if b is None else [b.grad])

    # inputs rounded to bfloat16 first, so the comparison measures the op's own rounding
    hidden, weight = hidden.bfloat16().double(), weight.bfloat16().double()
    bias = None if bias is None else bias.bfloat16().double()
    ref = grads(torch.float64, 1000)
    for got in (grads(torch.bfloat16, 1), grads(torch.bfloat16, 7)):
        for a, r in zip(got, ref, strict=True):
            assert a.dtype == torch.bfloat16
            rel = (a.double() - r).norm() / r.norm()
            assert rel < 1.05e-2, rel


def test_a_failing_compile_warns_once_and_the_kernel_runs_eagerly(monkeypatch):
    monkeypatch.setattr(logprobs_module, "_compiled", {})
    monkeypatch.setattr(logprobs_module, "_compile_error", [])
    monkeypatch.setattr(logprobs_module, "_use_fused", lambda x: not logprobs_module._compile_error)
    calls = []

    def broken_compile(fn):
        def compiled(*args):
            calls.append(fn.__name__)
            raise RuntimeError("no triton")
        return compiled

    monkeypatch.setattr(logprobs_module, "_compile", broken_compile)
    hidden, weight, _, targets = _inputs()
    leaves = [x.clone().requires_grad_() for x in (hidden, weight)]
    with pytest.warns(RuntimeWarning, match="no triton.*runs eagerly"):
        out = chunked_token_logprobs(*leaves, targets, temperature=0.7, chunk_size=5)
    (out.logprobs.sum() + out.entropy.sum()).backward()  # eager from now on: no second warning, no call
    ref = [x.clone().requires_grad_() for x in (hidden, weight)]
    lp, ent = _naive(*ref, None, targets, 0.7)
    (lp.sum() + ent.sum()).backward()
    assert calls == ["_fused_stats"]
    torch.testing.assert_close(out.logprobs, lp.detach(), rtol=0, atol=1e-10)
    for ours, want in zip(leaves, ref, strict=True):
        torch.testing.assert_close(ours.grad, want.grad, rtol=0, atol=1e-10)


def test_the_environment_variable_turns_compiling_off():
    import os
    import subprocess
    import sys

    code = "from flashrl.ops import logprobs; print(logprobs.COMPILE_ON_CUDA)"
    seen = {}
    for value in ("0", "1", None):
        env = {k: v for k, v in os.environ.items() if k != "FLASHRL_COMPILE_LOGPROBS"}
        if value is not None:
            env["FLASHRL_COMPILE_LOGPROBS"] = value
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        seen[value] = out.stdout.strip()
    assert seen == {"0": "False", "1": "True", None: "True"}


def test_bad_inputs():
    hidden, weight, _, targets = _inputs(dtype=torch.float32)
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 53\)"):
        chunked_token_logprobs(hidden, weight, targets + 100)
    with pytest.raises(ValueError, match=r"targets must have shape \[37\]"):
        chunked_token_logprobs(hidden, weight, targets[:3])
    with pytest.raises(ValueError, match="same H"):
        chunked_token_logprobs(hidden, weight[:, :3], targets)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        chunked_token_logprobs(hidden, weight, targets, temperature=0.0)
