"""Packed log-probs: equal to the padded ones (values, entropies, gradients), never across sequences."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from flashrl.learners.packing import pack_rows, unpack_rows
from flashrl.models import (
    compute_packed_token_logprobs,
    compute_token_logprobs,
    packing_tolerance,
    verify_packed_attention,
)

LENGTHS = [2, 37, 5, 64, 1, 9]
"""Very different lengths: one prompt token + one generated token, a lone prompt token, 64 tokens."""

PADDED_ATOL = 1e-12
"""Packed vs padded in float64, every model and attention (measured: 0 for values, 2e-15 for grads)."""
ALONE_ATOL = {"sdpa": 1e-12, "eager": 2e-6, "flex_attention": 1e-12}
"""Packed vs each sequence scored alone in float64. Eager upcasts its attention softmax to float32 (as
transformers does on purpose), and a [1, n] forward rounds differently from a [1, N] one: measured 8e-7.
FlexAttention in float64 on CPU runs torch's unfused reference (``flex_dtype_context``)."""


def _qwen2(impl: str, *, sliding_window: int | None = None) -> torch.nn.Module:
    """A tiny Qwen2: q/k/v biases, GQA (4 heads, 2 KV heads), untied head; optionally sliding windows."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.2,
        tie_word_embeddings=False,
        use_sliding_window=sliding_window is not None,
        sliding_window=sliding_window,
        max_window_layers=1,  # layer 0 full attention, layer 1 sliding
    )
    config._attn_implementation = impl
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).eval()


def _model(name: str, impl: str, dtype: torch.dtype, tiny_llama_path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if name == "llama":
        model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=dtype, attn_implementation=impl)
    elif name == "qwen2":
        model = _qwen2(impl)
    elif name == "qwen2_sliding":
        model = _qwen2(impl, sliding_window=4)  # shorter than most sequences: the window really cuts
    else:
        raise AssertionError(name)
    model = model.to(dtype).eval()
    assert model.config._attn_implementation == impl
    return model


def _rows(vocab: int, lengths: list[int] = LENGTHS, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``[B, T]`` token ids (pad 0) and attention mask."""
    t = max(lengths)
    ids = torch.randint(1, vocab, (len(lengths), t), generator=torch.Generator().manual_seed(seed))  # [B, T]
    mask = torch.arange(t).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)  # [B, T]
    return ids.masked_fill(~mask, 0), mask


def _packed(model, ids, mask, **kwargs):
    packed = pack_rows(ids, mask)
    lp, ent = compute_packed_token_logprobs(model, packed.input_ids, packed.position_ids, **kwargs)  # [1, N]
    return unpack_rows(lp, packed), None if ent is None else unpack_rows(ent, packed)  # [B, T]


MODELS = [
    ("llama", "sdpa"), ("llama", "eager"), ("qwen2", "sdpa"), ("qwen2", "eager"), ("qwen2_sliding", "sdpa"),
    ("llama", "flex_attention"), ("qwen2", "flex_attention"), ("qwen2_sliding", "flex_attention"),
]
"""Forward passes; FlexAttention has no backward on CPU (torch 2.13), so gradients are checked without it."""


@pytest.mark.parametrize(("name", "impl"), MODELS)
def test_packed_equals_padded_and_alone_float64(name: str, impl: str, tiny_llama_path: str) -> None:
    model = _model(name, impl, torch.float64, tiny_llama_path)
    # The padded reference: the same weights with sdpa where the packed model runs FlexAttention (compiled
    # flex refuses float64 on CPU, and another kernel makes the comparison stronger).
    ref = _model(name, "sdpa", torch.float64, tiny_llama_path) if impl == "flex_attention" else model
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters(), strict=True))
    ids, mask = _rows(model.config.vocab_size)
    with torch.no_grad():
        lp, ent = _packed(model, ids, mask, chunk_size=7)  # [B, T]
        ref_lp, ref_ent = compute_token_logprobs(ref, ids, mask, chunk_size=7)  # [B, T]
        alone = [compute_token_logprobs(ref, ids[i : i + 1, :n], mask[i : i + 1, :n]) for i, n in
                 enumerate(LENGTHS)]
    assert lp.dtype == torch.float64 and lp.shape == ids.shape
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=PADDED_ATOL)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=PADDED_ATOL)
    atol = ALONE_ATOL[impl]
    for i, (a_lp, a_ent) in enumerate(alone):
        n = LENGTHS[i]
        torch.testing.assert_close(lp[i, :n], a_lp[0], rtol=0, atol=atol)
        torch.testing.assert_close(ent[i, :n], a_ent[0], rtol=0, atol=atol)
    # First token of each sequence, and padding: exactly 0. The lone prompt token scores nothing.
    assert torch.all(lp[:, 0] == 0) and torch.all(ent[:, 0] == 0)
    assert torch.all(lp[~mask] == 0) and torch.all(ent[~mask] == 0)
    assert lp[4].abs().sum() == 0
    # Real predictions: negative log-probs, positive entropies (the check above is not vacuous).
    predicted = mask.clone()
    predicted[:, 0] = False
    assert bool((lp[predicted] < 0).all()) and bool((ent[predicted] > 0).all())


@pytest.mark.parametrize(
    ("name", "impl", "temperature"),
    [("llama", "sdpa", 1.0), ("llama", "sdpa", 0.7), ("qwen2", "flex_attention", 0.7)],
)
def test_packed_equals_padded_float32(name: str, impl: str, temperature: float, tiny_llama_path: str) -> None:
    """The learner's dtype: float32 agrees with the padded path to float32 rounding (flex: float32 only)."""
    model = _model(name, impl, torch.float32, tiny_llama_path)
    ids, mask = _rows(model.config.vocab_size, seed=1)
    with torch.no_grad():
        lp, ent = _packed(model, ids, mask, temperature=temperature)
        ref_lp, ref_ent = compute_token_logprobs(model, ids, mask, temperature=temperature)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-5)  # measured 4e-6
    # Entropies are about 8 nats here (float32 spacing 1e-6) and sum V terms in a kernel-dependent order:
    # a few ulps of relative error (seen: 1.4e-6) on top of the absolute bound.
    torch.testing.assert_close(ent, ref_ent, rtol=3e-6, atol=1e-5)


@pytest.mark.parametrize(("name", "impl"), [("llama", "sdpa"), ("qwen2", "sdpa"), ("qwen2", "eager")])
def test_gradients_equal_padded(name: str, impl: str, tiny_llama_path: str) -> None:
    """Backward through a weighted sum of log-probs and entropies: every parameter gradient matches."""
    model = _model(name, impl, torch.float64, tiny_llama_path)
    ids, mask = _rows(model.config.vocab_size, seed=2)
    gen = torch.Generator().manual_seed(3)
    w_lp = torch.randn(ids.shape, generator=gen, dtype=torch.float64)  # [B, T]
    w_ent = torch.randn(ids.shape, generator=gen, dtype=torch.float64)  # [B, T]

    def grads(fn) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        lp, ent = fn(model, ids, mask, chunk_size=16)
        ((w_lp * lp).sum() + (w_ent * ent).sum()).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref = grads(compute_token_logprobs)
    got = grads(_packed)
    model.zero_grad(set_to_none=True)
    assert got.keys() == ref.keys() and len(ref) == len(list(model.parameters()))
    worst = 0.0
    for n in ref:
        scale = float(ref[n].abs().max())
        assert scale > 0, f"{n} got no gradient"
        worst = max(worst, float((got[n] - ref[n]).abs().max()) / scale)
    # Relative to each tensor's largest entry (measured: 2e-15 at most).
    assert worst <= 1e-12, worst


@pytest.mark.parametrize("impl", ["sdpa", "flex_attention"])
def test_no_attention_across_sequences(impl: str, tiny_llama_path: str) -> None:
    """Changing one packed sequence leaves its neighbours' log-probs as they were."""
    model = _model("llama", impl, torch.float64, tiny_llama_path)
    ids, mask = _rows(model.config.vocab_size, lengths=[6, 8, 5], seed=4)
    changed = ids.clone()
    changed[0, :6] = (ids[0, :6] + 101) % model.config.vocab_size
    with torch.no_grad():
        before, _ = _packed(model, ids, mask)
        after, _ = _packed(model, changed, mask)
    torch.testing.assert_close(after[1:], before[1:], rtol=0, atol=1e-12)
    assert float((after[0] - before[0]).abs().max()) > 0.1  # the changed sequence did change


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_transformers_builds_the_block_diagonal_causal_mask(impl: str) -> None:
    """The mechanism itself: with packed position_ids and no 2D mask, transformers' mask is block-diagonal."""
    from transformers.masking_utils import create_causal_mask

    model = _qwen2(impl)
    position_ids = torch.tensor([[0, 1, 2, 0, 0, 1, 2, 3]])  # sequences of 3, 1 and 4 tokens
    embeds = torch.zeros(1, 8, model.config.hidden_size)
    mask = create_causal_mask(
        config=model.config, inputs_embeds=embeds, attention_mask=None, past_key_values=None,
        position_ids=position_ids,
    )  # [1, 1, 8, 8]: bool (sdpa, True = attend) or additive float (eager, 0 = attend)
    allowed = mask if mask.dtype == torch.bool else mask == 0
    seq = torch.tensor([0, 0, 0, 1, 2, 2, 2, 2])
    expected = (seq.unsqueeze(1) == seq.unsqueeze(0)) & torch.ones(8, 8, dtype=torch.bool).tril()  # [8, 8]
    assert torch.equal(allowed[0, 0], expected)


@pytest.mark.parametrize("impl", ["sdpa", "flex_attention"])
def test_verify_packed_attention_passes_and_catches_leaks(impl: str, tiny_llama_path: str, monkeypatch) -> None:
    model = _model("llama", impl, torch.float32, tiny_llama_path)
    assert verify_packed_attention(model) <= 1e-5
    # A model whose mask code does not detect packing (simulated): the probe must notice.
    from transformers import masking_utils

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)
    with pytest.raises(RuntimeError, match="attend to each other"):
        verify_packed_attention(model)


def test_packing_tolerance_is_the_compute_dtypes() -> None:
    assert packing_tolerance(torch.float32) == packing_tolerance(torch.float64) == 1e-4
    assert packing_tolerance(torch.bfloat16) == packing_tolerance(torch.float16) == 0.2


def test_a_bfloat16_model_passes_the_probe_and_its_leaks_are_still_caught(tiny_llama_path: str, monkeypatch) -> None:
    """16-bit rounding must not refuse a working mask (it did on a GPU: 0.033 apart, sdpa, bfloat16)."""
    model = _model("llama", "sdpa", torch.bfloat16, tiny_llama_path)
    assert verify_packed_attention(model) <= packing_tolerance(torch.bfloat16)
    from transformers import masking_utils

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)
    with pytest.raises(RuntimeError, match=r"attend to each other: packed and separate log-probs differ by .* "
                                           r"\(expected <= 0.2\)"):
        verify_packed_attention(model)  # a leak moves this model's probe by about 3.9


def test_unsupported_attention_is_refused() -> None:
    stub = SimpleNamespace(config=SimpleNamespace(_attn_implementation="my_custom_kernel"))
    with pytest.raises(NotImplementedError, match="my_custom_kernel"):
        compute_packed_token_logprobs(stub, torch.zeros(1, 3, dtype=torch.long), torch.arange(3).unsqueeze(0))


@pytest.mark.parametrize(
    ("positions", "message"),
    [
        ([[1, 2, 3]], "position 0 is 1"),
        ([[0, 1, 3]], "position 2 is 3 after 1"),
        ([[0, 1, 1]], "position 2 is 1 after 1"),
    ],
)
def test_bad_position_ids_are_refused(positions, message: str, tiny_llama_path: str) -> None:
    model = _model("llama", "sdpa", torch.float32, tiny_llama_path)
    with pytest.raises(ValueError, match=message):
        compute_packed_token_logprobs(model, torch.ones(1, 3, dtype=torch.long), torch.tensor(positions))
    with pytest.raises(ValueError, match=r"\[1, N\]"):
        compute_packed_token_logprobs(
            model, torch.ones(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long)
        )


def test_without_entropy_and_single_token(tiny_llama_path: str) -> None:
    model = _model("llama", "sdpa", torch.float32, tiny_llama_path)
    with torch.no_grad():
        lp, ent = compute_packed_token_logprobs(
            model, torch.tensor([[5, 6, 7]]), torch.tensor([[0, 1, 0]]), with_entropy=False
        )
        single, _ = compute_packed_token_logprobs(model, torch.tensor([[5]]), torch.tensor([[0]]))
    assert ent is None and lp.shape == (1, 3) and lp[0, 0] == 0 and lp[0, 2] == 0 and lp[0, 1] < 0
    assert torch.equal(single, torch.zeros(1, 1))


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["sdpa", "flash_attention_2"])
def test_packed_equals_padded_on_cuda(impl: str, tiny_llama_path: str) -> None:
    """The GPU paths (not run on CPU machines): sdpa's packed mask, and flash's explicit varlen kwargs."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (the 'gpu' marker)")
    if impl == "flash_attention_2":
        pytest.importorskip("flash_attn", reason="flash_attention_2 needs the flash-attn package")
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if impl.startswith("flash") else torch.float32  # flash kernels take 16-bit only
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=dtype, attn_implementation=impl)
    model = model.to("cuda").eval()
    ids, mask = _rows(model.config.vocab_size)
    ids, mask = ids.cuda(), mask.cuda()
    with torch.no_grad():
        lp, ent = _packed(model, ids, mask)
        ref_lp, ref_ent = compute_token_logprobs(model, ids, mask)
    atol = 5e-2 if dtype == torch.bfloat16 else 1e-4  # bf16 hidden states: ~3 significant digits
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=atol)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=atol)


def test_flex_block_mask_is_the_document_mask() -> None:
    """The mechanism of pack_attention='flex': transformers' BlockMask from packed positions is block-diagonal."""
    from transformers.masking_utils import create_causal_mask

    model = _qwen2("flex_attention")
    position_ids = torch.tensor([[0, 1, 2, 0, 0, 1, 2, 3]])  # sequences of 3, 1 and 4 tokens
    embeds = torch.zeros(1, 8, model.config.hidden_size)
    mask = create_causal_mask(
        config=model.config, inputs_embeds=embeds, attention_mask=None, past_key_values=None,
        position_ids=position_ids,
    )
    from torch.nn.attention.flex_attention import BlockMask

    assert isinstance(mask, BlockMask)
    seq = torch.tensor([0, 0, 0, 1, 2, 2, 2, 2])
    expected = (seq.unsqueeze(1) == seq.unsqueeze(0)) & torch.ones(8, 8, dtype=torch.bool).tril()  # [8, 8]
    q, k = torch.arange(8).unsqueeze(1), torch.arange(8).unsqueeze(0)  # [8, 1], [1, 8]
    zero = torch.zeros((), dtype=torch.long)
    assert torch.equal(mask.mask_mod(zero, zero, q, k), expected)


def test_flex_in_float64_on_cpu_runs_unfused(tiny_llama_path: str) -> None:
    """Compiled FlexAttention refuses float64 on CPU; the packed path runs it unfused instead (exact)."""
    from flashrl.models.packed_attention import flex_dtype_context

    model = _model("llama", "flex_attention", torch.float64, tiny_llama_path)
    ids, mask = _rows(model.config.vocab_size, lengths=[4, 3])
    packed = pack_rows(ids, mask)
    cpu = torch.device("cpu")
    assert isinstance(flex_dtype_context("flex_attention", torch.float32, cpu), contextlib.nullcontext)
    assert isinstance(flex_dtype_context("sdpa", torch.float64, cpu), contextlib.nullcontext)
    with torch.no_grad(), pytest.raises(Exception, match="float64"):  # what the context avoids
        model.get_decoder()(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False)
    with torch.no_grad():
        lp, _ = compute_packed_token_logprobs(model, packed.input_ids, packed.position_ids)
    assert lp.dtype == torch.float64 and bool((lp != 0).any())


@pytest.mark.parametrize(
    ("choice", "device", "loaded", "supports_flex", "expected"),
    [
        (None, "cuda", "sdpa", True, "flex_attention"),  # auto on a GPU: FlexAttention
        (None, "cuda", "sdpa", False, "sdpa"),  # ... unless the architecture has no flex path
        (None, "cuda", "flash_attention_2", True, "flash_attention_2"),  # loaded with flash: its varlen kernel
        (None, "cpu", "sdpa", True, "sdpa"),  # CPU: the materialised mask (FlexAttention has no backward)
        (None, "cpu", "eager", True, "eager"),
        (None, "cpu", "flex_attention", True, "sdpa"),
        ("sdpa_mask", "cuda", "sdpa", True, "sdpa"),
        ("flex", "cuda", "sdpa", True, "flex_attention"),
        ("flash_varlen", "cuda", "flash_attention_3", True, "flash_attention_3"),
    ],
)
def test_packed_attention_choice(choice, device: str, loaded: str, supports_flex: bool, expected: str) -> None:
    from flashrl.models import packed_attention_implementation

    got = packed_attention_implementation(choice, torch.device(device), loaded, supports_flex=supports_flex)
    assert got == expected


@pytest.mark.parametrize(
    ("choice", "device", "loaded", "message"),
    [
        ("flex", "cpu", "sdpa", "no backward on CPU"),
        ("flash_varlen", "cuda", "sdpa", "needs a model loaded with a flash_attention"),
        ("varlen", "cuda", "sdpa", "expected None \\(auto\\) or one of flex, sdpa_mask, flash_varlen; got 'varlen'"),
    ],
)
def test_packed_attention_refusals(choice: str, device: str, loaded: str, message: str) -> None:
    from flashrl.models import packed_attention_implementation

    with pytest.raises(ValueError, match=message):
        packed_attention_implementation(choice, torch.device(device), loaded)
    # Forward passes (no learner) may use FlexAttention on CPU.
    if choice == "flex":
        assert packed_attention_implementation(choice, torch.device(device), loaded, training=False) == "flex_attention"


def test_flex_keeps_an_episodes_segments_apart(tiny_llama_path: str) -> None:
    """Episodes of several segments (positions restart inside a row): FlexAttention scores each segment alone."""
    flex = _model("llama", "flex_attention", torch.float64, tiny_llama_path)
    sdpa = _model("llama", "sdpa", torch.float64, tiny_llama_path)
    ids, mask = _rows(flex.config.vocab_size, lengths=[9, 6], seed=5)
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1], [0, 1, 2, 0, 1, 2, 0, 0, 0]])  # 4 + 3 + 2; 3 + 3
    packed = pack_rows(ids, mask, positions=positions)
    assert packed.num_sequences == 5
    with torch.no_grad():
        got = unpack_rows(compute_packed_token_logprobs(flex, packed.input_ids, packed.position_ids)[0], packed)
        ref = unpack_rows(compute_packed_token_logprobs(sdpa, packed.input_ids, packed.position_ids)[0], packed)
        alone = [compute_token_logprobs(sdpa, ids[r : r + 1, a:b], mask[r : r + 1, a:b])[0][0]
                 for r, a, b in ((0, 0, 4), (0, 4, 7), (0, 7, 9), (1, 0, 3), (1, 3, 6))]
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
    segments = torch.cat([got[0, :4], got[0, 4:7], got[0, 7:9], got[1, :3], got[1, 3:6]])
    torch.testing.assert_close(segments, torch.cat(alone), rtol=0, atol=1e-12)
    assert got[0, 4] == 0 and got[0, 7] == 0 and got[1, 3] == 0  # a segment's first token: no prediction
