"""The tiny random-weight Llama used by tests."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from flashrl.models import build_tiny_llama


def test_same_seed_same_weights_other_seed_differs(
    tiny_llama_path: str, smollm2_path: str, tmp_path: Path
) -> None:
    again = build_tiny_llama(tmp_path / "a", seed=0, tokenizer_source=smollm2_path)
    other = build_tiny_llama(tmp_path / "b", seed=1, tokenizer_source=smollm2_path)
    w0 = load_file(Path(tiny_llama_path) / "model.safetensors")
    w0b = load_file(Path(again) / "model.safetensors")
    w1 = load_file(Path(other) / "model.safetensors")
    assert w0.keys() == w0b.keys() == w1.keys()
    assert all(torch.equal(w0[k], w0b[k]) for k in w0)
    assert not torch.equal(w0["model.embed_tokens.weight"], w1["model.embed_tokens.weight"])


def test_config_follows_tokenizer_and_overrides(smollm2_path: str, tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    path = build_tiny_llama(tmp_path / "m", num_hidden_layers=3, tokenizer_source=smollm2_path)
    config = AutoConfig.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert config.num_hidden_layers == 3 and config.hidden_size == 128
    assert config.vocab_size == len(tok) == 49152
    assert config.eos_token_id == tok.eos_token_id == 2
    assert tok.chat_template == AutoTokenizer.from_pretrained(smollm2_path).chat_template
