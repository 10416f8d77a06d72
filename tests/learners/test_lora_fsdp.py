"""FSDP2 over a peft-injected model, on 2 CPU ranks: the sharding a sharded LoRA learner is built on.

flashrl's ``shard_model`` (``fully_shard`` per decoder layer and on the root, frozen base and trainable
adapter in the same units) over the tiny model with peft's adapter, two gloo ranks with half the batch
each, takes the same SGD step on the adapter as one unsharded process on the whole batch (float64), and
gives the frozen base no gradient. The sharded learners themselves (``ShardedPolicy`` with ``lora_rank``) are
tested in ``test_lora_sharded.py``. Run as a script, this file is one rank (``python test_lora_fsdp.py train
OUT MODEL``, with RANK, WORLD_SIZE, MASTER_PORT set).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

BATCH, SEQ, LR, DTYPE = 4, 10, 0.1, torch.float64


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (BATCH, SEQ), generator=gen)  # [B, T]
    weights = torch.tensor([1.0, -0.5, 0.25, -0.75], dtype=DTYPE)  # [B] advantage-like
    return ids, weights


def _adapted(model_dir: str) -> torch.nn.Module:
    """The model with a rank-4 adapter on every linear layer, lora_A and lora_B random (peft's B starts at 0)."""
    from transformers import AutoModelForCausalLM

    from flashrl.models.lora import LoRASettings, apply_lora

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPE).eval()
    apply_lora(model, LoRASettings(rank=4, alpha=8.0))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen, dtype=DTYPE))
    return model


def _step(model: torch.nn.Module, ids: torch.Tensor, weights: torch.Tensor) -> None:
    """One SGD step on the trainable parameters; the loss of these rows with the GLOBAL normaliser."""
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    logits = model(input_ids=ids).logits[:, :-1]  # [b, T-1, V]
    logq = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # [b, T-1]
    (-(weights * logq.mean(-1)).sum() / BATCH).backward()
    optimizer.step()


def _worker(out: Path, model_dir: str) -> None:
    from flashrl.learners import distributed, fsdp

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    distributed.init_process_group(master_addr="127.0.0.1", master_port=int(os.environ["MASTER_PORT"]), rank=rank,
                                   world_size=world, backend="gloo", timeout_s=120)
    torch.set_num_threads(1)
    model = fsdp.shard_model(_adapted(model_dir))
    ids, weights = _batch()
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    _step(model, ids[rows], weights[rows])
    result = {"frozen_with_grad": [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None],
              "units": sum(isinstance(m, fsdp.FSDPModule) for m in model.modules()),
              "adapter": {n: t for n, t in fsdp.iter_full_tensors(model) if ".lora_" in n}}  # fmt: skip
    if rank == 0:
        torch.save(result, out / "sharded.pt")
    torch.distributed.barrier()  # no rank tears gloo down while its peer still works (it aborted once in the suite)
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("lora_fsdp_model")
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                         tie_word_embeddings=True, initializer_range=0.2)
    LlamaForCausalLM(config).to(DTYPE).save_pretrained(out)
    return str(out)


def test_fsdp2_over_a_peft_model_takes_the_unsharded_adapter_step(model_dir: str, tmp_path: Path) -> None:
    from .test_fsdp import _launch

    _launch("train", 2, tmp_path, Path(model_dir), script=__file__)
    sharded = torch.load(tmp_path / "sharded.pt", weights_only=True)

    reference = _adapted(model_dir)
    before = {n: p.detach().clone() for n, p in reference.named_parameters() if p.requires_grad}
    _step(reference, *_batch())
    after = {n: p.detach() for n, p in reference.named_parameters() if p.requires_grad}
    assert sharded["units"] == 3 and sharded["frozen_with_grad"] == []  # 2 decoder layers and the root
    assert sharded["adapter"].keys() == after.keys() and len(after) == 2 * 7 * 2
    for name, expected in after.items():
        assert not torch.equal(expected, before[name]), name  # the step moved every adapter tensor
        torch.testing.assert_close(sharded["adapter"][name], expected, rtol=0, atol=1e-12, msg=name)


if __name__ == "__main__":
    _worker(Path(sys.argv[2]), sys.argv[3])
