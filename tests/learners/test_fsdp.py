"""FSDP2 sharding, DCP checkpoints and the Hugging Face export, on 2 CPU ranks.

One pair of rank processes (gloo, float64 so the comparison is exact up to summation order) runs every
scenario once per session and writes what it saw; the tests below compare it with an unsharded
single-process AdamW update on the whole batch, computed here. Run as a script, this file is one
rank (``python test_fsdp.py train|resume OUT_DIR MODEL_DIR``, with RANK, WORLD_SIZE, MASTER_PORT set).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORLD_SIZE = 2
BATCH = 4  # rows; each rank takes BATCH // WORLD_SIZE
SEQ = 10
LR = 1e-2
WEIGHT_DECAY = 0.1
MAX_NORM = 0.05  # below the gradient norm, so clipping is active and its global norm matters
DTYPE = torch.float64
SCENARIOS = {
    "plain": {"activation_checkpointing": False, "cpu_offload": False},
    "checkpointed": {"activation_checkpointing": True, "cpu_offload": False},
    "offloaded": {"activation_checkpointing": False, "cpu_offload": True},
    "meta_init": {"activation_checkpointing": True, "cpu_offload": True},  # via load_pretrained_sharded
    "kernel": {"activation_checkpointing": True, "cpu_offload": False},  # the learner's log-prob kernel
}
KERNEL_SCENARIOS = {"kernel"}
"""Scenarios whose loss takes log-probs from flashrl.models.compute_token_logprobs (through the root)."""
WORKER_TIMEOUT_S = 240


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=True,
        initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids [B, T], loss mask [B, T] (ragged: row i scores its last 3 + 2i tokens), weights [B]."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (BATCH, SEQ), generator=gen)  # [B, T]
    mask = torch.zeros(BATCH, SEQ, dtype=torch.bool)  # [B, T]
    for i in range(BATCH):
        mask[i, SEQ - 3 - 2 * i :] = True
    weights = torch.tensor([1.0, -0.5, 0.25, -0.75], dtype=DTYPE)  # [B] advantage-like
    return ids, mask, weights


def _loss(model, ids, mask, weights, num_rows: int, kernel: bool) -> torch.Tensor:
    """Sample-mean loss of these rows with the GLOBAL normaliser: -(1/B) sum_i w_i / T_i sum_t log q_it.

    ``kernel``: log-probs from the chunked kernel the learner uses, which calls the decoder and reads
    the head's weight itself, so a sharded model must run it through ``call_through_root``.
    """
    if kernel:
        from flashrl.learners.fsdp import call_through_root
        from flashrl.models import compute_token_logprobs

        logprobs, _ = call_through_root(model, compute_token_logprobs, ids, torch.ones_like(ids),
                                        with_entropy=False)  # [b, T]
        logq = logprobs[:, 1:]  # [b, T-1]
    else:
        logits = model(input_ids=ids).logits[:, :-1].to(DTYPE)  # [b, T-1, V]
        logq = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # [b, T-1]
    valid = mask[:, 1:]  # [b, T-1]
    per_row = (logq * valid).sum(-1) / valid.sum(-1)  # [b]
    return -(weights * per_row).sum() / num_rows


def _step(model, optimizer, batch, rows: slice, clip, kernel: bool = False) -> float:
    ids, mask, weights = batch
    optimizer.zero_grad(set_to_none=True)
    _loss(model, ids[rows], mask[rows], weights[rows], BATCH, kernel).backward()
    norm = float(clip(model.parameters(), MAX_NORM))
    optimizer.step()
    return norm


# --------------------------------------------------------------------------------------------------
# The rank processes
def _join() -> tuple[int, int]:
    from flashrl.learners import distributed

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    distributed.init_process_group(master_addr="127.0.0.1", master_port=int(os.environ["MASTER_PORT"]), rank=rank,
                           world_size=world, backend="gloo", timeout_s=120)
    torch.set_num_threads(1)
    return rank, world


def _worker(out_dir: Path, model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    from flashrl.checkpoints import dcp
    from flashrl.checkpoints.export import export_hf
    from flashrl.learners import fsdp

    rank, world = _join()
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    batches = [_batch(1), _batch(2)]

    layer_calls = [0]

    def count_call(module, args, kwargs) -> None:
        layer_calls[0] += 1

    def build(scenario, options):
        if scenario == "meta_init":
            model = fsdp.load_pretrained_sharded(model_dir, dtype=DTYPE, **options)
        else:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPE).eval()
            model = fsdp.shard_model(model, **options)
        for layer in fsdp.decoder_layers(model):  # the layers themselves: fires again on a recompute
            inner = getattr(layer, "_checkpoint_wrapped_module", layer)
            inner.register_forward_pre_hook(count_call, with_kwargs=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        return model, optimizer

    for scenario, options in SCENARIOS.items():
        result: dict = {}
        model, optimizer = build(scenario, options)
        result["tied"] = model.lm_head.weight is model.model.embed_tokens.weight
        if scenario in KERNEL_SCENARIOS:  # the kernel alone never runs the root's hooks
            from flashrl.models import compute_token_logprobs

            try:
                compute_token_logprobs(model, batches[0][0][rows], torch.ones_like(batches[0][0][rows]))
                result["direct_kernel_error"] = None
            except RuntimeError as error:
                result["direct_kernel_error"] = str(error)
        result["num_fsdp_units"] = sum(isinstance(m, fsdp.FSDPModule) for m in model.modules())
        layer_calls[0] = 0
        kernel = scenario in KERNEL_SCENARIOS
        result["norm1"] = _step(model, optimizer, batches[0], rows, fsdp.clip_grad_norm, kernel)
        result["layer_calls"] = layer_calls[0]
        result["step1"] = dict(fsdp.iter_full_tensors(model))
        ckpt = out_dir / f"{scenario}-dcp"
        dcp.save_sharded(ckpt, model, optimizer, extra_state={"version": 1, "norm1": result["norm1"]})
        if scenario == "plain":
            export_hf(model, out_dir / "hf", tensors=fsdp.unique_state_items(model), gather=fsdp.gather_full)
            export_hf(model, out_dir / "hf_bf16", tensors=fsdp.unique_state_items(model), gather=fsdp.gather_full,
                      dtype=torch.bfloat16, tokenizer_source=os.environ["TOKENIZER_SOURCE"])
        result["norm2"] = _step(model, optimizer, batches[1], rows, fsdp.clip_grad_norm, kernel)
        result["step2"] = dict(fsdp.iter_full_tensors(model))
        del model, optimizer

        resumed, resumed_optimizer = build(scenario, options)
        result["extra"] = dcp.load_sharded(ckpt, resumed, resumed_optimizer)
        result["resumed_norm2"] = _step(resumed, resumed_optimizer, batches[1], rows, fsdp.clip_grad_norm,
                                        kernel)
        result["resumed_step2"] = dict(fsdp.iter_full_tensors(resumed))
        if rank == 0:
            torch.save(result, out_dir / f"{scenario}.pt")
        del resumed, resumed_optimizer
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _resume_worker(out_dir: Path, model_dir: Path) -> None:
    """Load the 2-rank checkpoint of the plain scenario on this many ranks and take the second step."""
    from flashrl.checkpoints import dcp
    from flashrl.learners import fsdp

    rank, world = _join()
    model = fsdp.load_pretrained_sharded(model_dir, dtype=DTYPE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    dcp.load_sharded(out_dir / "plain-dcp", model, optimizer)
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    result = {"norm2": _step(model, optimizer, _batch(2), rows, fsdp.clip_grad_norm)}
    result["step2"] = dict(fsdp.iter_full_tensors(model))
    if rank == 0:
        torch.save(result, out_dir / f"resumed-on-{world}.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


# --------------------------------------------------------------------------------------------------
# Fixtures: the unsharded reference and the 2-rank run
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("fsdp_model")
    LlamaForCausalLM(_config()).to(DTYPE).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def references(model_dir: Path) -> dict[bool, dict]:
    """One process, no sharding, the whole batch: the update the sharded ranks must reproduce.

    Keyed by ``kernel`` (how the loss takes its log-probs).
    """
    from transformers import AutoModelForCausalLM

    refs = {}
    for kernel in (False, True):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPE).eval()
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        out: dict = {"initial": {k: v.clone() for k, v in model.state_dict().items()}}
        out["norm1"] = _step(model, optimizer, _batch(1), slice(None), torch.nn.utils.clip_grad_norm_, kernel)
        out["step1"] = {k: v.clone() for k, v in model.state_dict().items()}
        out["norm2"] = _step(model, optimizer, _batch(2), slice(None), torch.nn.utils.clip_grad_norm_, kernel)
        out["step2"] = {k: v.clone() for k, v in model.state_dict().items()}
        refs[kernel] = out
    return refs


@pytest.fixture(scope="module")
def reference(references: dict[bool, dict]) -> dict:
    return references[False]


def _launch(mode: str, world_size: int, out: Path, model_dir: Path, tokenizer: str = "", script: str = __file__) -> None:
    """Run ``world_size`` rank processes of ``script`` (this file) in ``mode``; fail with their logs if one fails."""
    from flashrl.learners.distributed import find_free_port

    port = find_free_port()
    root = Path(__file__).resolve().parents[2]
    procs = []
    for rank in range(world_size):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world_size), "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1", "TOKENIZER_SOURCE": tokenizer,
               "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
        log = open(out / f"{mode}-rank{rank}.log", "w")  # noqa: SIM115  closed once the rank exits
        procs.append((subprocess.Popen([sys.executable, script, mode, str(out), str(model_dir)],
                                       env=env, stdout=log, stderr=subprocess.STDOUT), log))
    failed = []
    for rank, (proc, log) in enumerate(procs):
        try:
            code = proc.wait(timeout=WORKER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for other, _ in procs:
                other.kill()
            code = "timeout"
        log.close()
        if code != 0:
            tail = (out / f"{mode}-rank{rank}.log").read_text()[-4000:]
            failed.append(f"{mode} rank {rank} of {world_size} exited with {code}:\n{tail}")
    if failed:
        pytest.fail("\n".join(failed), pytrace=False)


@pytest.fixture(scope="module")
def ranks(model_dir: Path, smollm2_path: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Run the two rank processes once; returns rank 0's results per scenario."""
    out = tmp_path_factory.mktemp("fsdp_ranks")
    _launch("train", WORLD_SIZE, out, model_dir, tokenizer=smollm2_path)
    results = {name: torch.load(out / f"{name}.pt", weights_only=True) for name in SCENARIOS}
    results["_dir"] = out  # type: ignore[assignment]
    return results


def _max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), f"names differ: {sorted(set(a) ^ set(b))}"
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _unique(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A reference state dict without the tied alias (the gather yields it once)."""
    return {k: v for k, v in state.items() if k != "lm_head.weight"}


# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_two_sharded_ranks_take_the_single_rank_step(ranks, references, scenario: str) -> None:
    got = ranks[scenario]
    reference = references[scenario in KERNEL_SCENARIOS]
    assert got["tied"], "lm_head.weight must stay the same parameter as embed_tokens.weight after sharding"
    assert got["num_fsdp_units"] == 1 + _config().num_hidden_layers
    # Each layer runs once per step, and once more in backward when its activations are recomputed.
    checkpointed = SCENARIOS[scenario]["activation_checkpointing"]
    assert got["layer_calls"] == _config().num_hidden_layers * (2 if checkpointed else 1)
    # The clipped norm is the norm of the whole (unsharded, summed) gradient.
    assert got["norm1"] == pytest.approx(reference["norm1"], rel=1e-12)
    assert got["norm1"] > MAX_NORM, "the test needs active clipping"
    assert got["norm2"] == pytest.approx(reference["norm2"], rel=1e-12)
    assert _max_abs_diff(got["step1"], _unique(reference["step1"])) < 1e-12
    assert _max_abs_diff(got["step2"], _unique(reference["step2"])) < 1e-12
    # The step moved the weights far more than the tolerance (lr 1e-2): the comparison can fail.
    assert _max_abs_diff(got["step1"], _unique(reference["initial"])) > 1e-3


def test_the_kernel_needs_the_root_hooks_on_a_sharded_model(ranks) -> None:
    assert "mixed torch.Tensor and DTensor" in (ranks["kernel"]["direct_kernel_error"] or "")


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_dcp_resume_reproduces_the_next_step_exactly(ranks, scenario: str) -> None:
    got = ranks[scenario]
    assert got["extra"] == {"version": 1, "norm1": got["norm1"]}
    assert got["resumed_norm2"] == got["norm2"]
    for name, tensor in got["step2"].items():
        assert torch.equal(got["resumed_step2"][name], tensor), name


def test_dcp_checkpoint_of_two_ranks_resumes_on_one(ranks, model_dir: Path) -> None:
    """DCP reshards on load: one rank holding everything takes the same second step."""
    _launch("resume", 1, ranks["_dir"], model_dir)
    got = torch.load(ranks["_dir"] / "resumed-on-1.pt", weights_only=True)
    assert got["norm2"] == pytest.approx(ranks["plain"]["norm2"], rel=1e-12)
    assert _max_abs_diff(got["step2"], ranks["plain"]["step2"]) < 1e-12


def test_dcp_checkpoint_has_one_shard_file_per_rank(ranks) -> None:
    folder = ranks["_dir"] / "plain-dcp"
    assert sorted(p.name for p in folder.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert (folder / ".metadata").is_file()


def test_decoder_layers_fall_back_to_no_split_modules() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    from flashrl.learners.fsdp import decoder_layers

    model = GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=16, n_head=2, vocab_size=32, n_positions=16))
    assert not hasattr(model, "model")  # GPT-2 keeps its blocks at transformer.h
    assert decoder_layers(model) == list(model.transformer.h)
    with pytest.raises(ValueError, match="Found no decoder layers in Linear"):
        decoder_layers(torch.nn.Linear(2, 2))


def test_shard_model_without_a_process_group_says_how_to_start_one() -> None:
    from transformers import LlamaForCausalLM

    from flashrl.learners.fsdp import shard_model

    # Ranks run in their own processes; a group left behind in this one would be a leak (and hide this path).
    assert not torch.distributed.is_initialized(), "a test left a process group initialised in the test process"
    with pytest.raises(RuntimeError, match="init_process_group"):
        shard_model(LlamaForCausalLM(_config()))


def test_load_sharded_rejects_an_incomplete_folder(tmp_path: Path) -> None:
    from flashrl.checkpoints.dcp import load_sharded

    (tmp_path / "__0_0.distcp").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"\.metadata is missing"):
        load_sharded(tmp_path, torch.nn.Linear(2, 2))


def test_hf_export_loads_with_transformers_and_equals_the_gathered_weights(ranks) -> None:
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = ranks["_dir"] / "hf"
    config = AutoConfig.from_pretrained(folder)
    assert config.architectures == ["LlamaForCausalLM"]
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys()), "the tied head is stored once, as embed_tokens"
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPE)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    gathered = ranks["plain"]["step1"]
    state = _unique(loaded.state_dict())
    assert set(state) == set(gathered)
    for name, tensor in gathered.items():
        assert torch.equal(state[name], tensor), name


def test_hf_export_casts_for_serving_and_copies_the_tokenizer(ranks, smollm2_path: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder = ranks["_dir"] / "hf_bf16"
    assert AutoConfig.from_pretrained(folder).dtype == torch.bfloat16
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    assert loaded.dtype == torch.bfloat16
    for name, tensor in _unique(loaded.state_dict()).items():
        assert torch.equal(tensor, ranks["plain"]["step1"][name].to(torch.bfloat16)), name
    text = "What is 12 + 7?"
    expected = AutoTokenizer.from_pretrained(smollm2_path)(text).input_ids
    assert AutoTokenizer.from_pretrained(folder)(text).input_ids == expected


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="One rank of the FSDP tests (started by the fixtures).")
    parser.add_argument("mode", choices=["train", "resume"])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("model_dir", type=Path)
    args = parser.parse_args()
    (_worker if args.mode == "train" else _resume_worker)(args.out_dir, args.model_dir)


def test_replace_folder_refuses_a_file_in_the_way_and_leaves_it(tmp_path):
    from flashrl.checkpoints.export import replace_folder

    def write(folder):
        (folder / "config.json").write_text("{}")

    a_file = tmp_path / "policy"
    a_file.write_text("keep me")
    for target in (a_file, a_file / "inner"):  # the target itself, or a folder above it, is a file
        with pytest.raises(FileExistsError, match=r"policy is a file, expected a folder .* Fix: "):
            replace_folder(target, write)
    assert a_file.read_text() == "keep me" and sorted(p.name for p in tmp_path.iterdir()) == ["policy"]
    assert replace_folder(tmp_path / "new" / "policy", write) == str((tmp_path / "new" / "policy").resolve())
    assert replace_folder(tmp_path / "new" / "policy", write)  # a model folder is replaced
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == ["policy"]
