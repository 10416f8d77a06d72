"""Micro-batch planning (balanced ranks, token budget) and packing; a micro-batched update's gradient."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashrl.episode import Episode
from flashrl.learners import TrainBatch
from flashrl.learners.packing import (
    MicroBatchMembers,
    assign_to_ranks,
    gather_rows,
    pack_rows,
    plan_micro_batches,
    split_into_micro_batches,
    unpack_rows,
)

lengths_st = st.lists(st.integers(1, 200), min_size=1, max_size=40)


# ---------------------------------------------------------------------------------------------------
# Planning: exact plans
def test_ranks_exact_lpt_plan() -> None:
    # Longest first onto the least loaded rank: 10->r0, 9->r1, 8->r1 (9 < 10), 7->r0 (10 < 17),
    # 6->r0 (17 = 17, equal counts, lower rank), 5->r1 (22 < 23).
    assert assign_to_ranks([10, 9, 8, 7, 6, 5], 2) == ((0, 3, 4), (1, 2, 5))
    plan = plan_micro_batches([10, 9, 8, 7, 6, 5], world_size=2)
    assert plan.rank_tokens == (23, 22)
    assert [r.micro_batches for r in plan.ranks] == [
        (MicroBatchMembers(indices=(0, 3, 4), lengths=(10, 7, 6)),),
        (MicroBatchMembers(indices=(1, 2, 5), lengths=(9, 8, 5)),),
    ]


def test_ranks_tie_goes_to_fewer_trajectories() -> None:
    # 4->r0, 2->r1, 2->r1 (2 < 4): loads 4 and 4, counts 1 and 2; the last 1 goes to r0 (fewer rows).
    assert assign_to_ranks([4, 2, 2, 1], 2) == ((0, 3), (1, 2))


def test_micro_batches_exact_ffd_plan() -> None:
    # Budget 8: 6->mb0, 5->mb1, 4->mb2 (fits neither), 3->mb1 (5 + 3 = 8), 2->mb0 (6 + 2 = 8).
    mbs = split_into_micro_batches([6, 5, 4, 3, 2], range(5), 8)
    assert [(mb.indices, mb.num_tokens) for mb in mbs] == [((0, 4), 8), ((1, 3), 8), ((2,), 4)]
    assert not any(mb.over_budget for mb in mbs)


def test_over_budget_trajectory_goes_alone() -> None:
    mbs = split_into_micro_batches([3, 12, 2, 9], range(4), 10)
    assert [(mb.indices, mb.over_budget) for mb in mbs] == [((1,), True), ((3,), False), ((0, 2), False)]
    # A subset of rows: only those are planned, with their global indices.
    assert [mb.indices for mb in split_into_micro_batches([3, 12, 2, 9], [3, 0], 10)] == [(3,), (0,)]


def test_no_budget_is_one_micro_batch_per_rank() -> None:
    plan = plan_micro_batches(torch.tensor([5, 3, 8]), world_size=1)
    assert plan.ranks[0].micro_batches == (MicroBatchMembers(indices=(0, 1, 2), lengths=(5, 3, 8)),)
    assert plan.for_rank(0) is plan.ranks[0] and plan.num_trajectories == 3


@pytest.mark.parametrize(
    ("lengths", "kwargs", "message"),
    [
        ([3, 2], {"world_size": 3}, "cannot be split over 3 ranks"),
        ([3, 0], {}, r"lengths\[1\] is 0"),
        ([3, 2.5], {}, r"lengths\[1\] is 2.5"),
        ([3], {"world_size": 0}, "world_size must be >= 1"),
        ([3], {"max_tokens_per_micro_batch": 0}, "max_tokens_per_micro_batch must be >= 1"),
    ],
)
def test_bad_plans_are_refused(lengths, kwargs, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_micro_batches(lengths, **kwargs)


# ---------------------------------------------------------------------------------------------------
# Planning: properties
@settings(max_examples=200, deadline=None)
@given(lengths=lengths_st, world_size=st.integers(1, 8), budget=st.one_of(st.none(), st.integers(1, 400)))
def test_plan_properties(lengths: list[int], world_size: int, budget: int | None) -> None:
    if len(lengths) < world_size:
        with pytest.raises(ValueError, match="cannot be split"):
            plan_micro_batches(lengths, world_size=world_size, max_tokens_per_micro_batch=budget)
        return
    plan = plan_micro_batches(lengths, world_size=world_size, max_tokens_per_micro_batch=budget)
    # Deterministic, and the same from a tensor.
    assert plan == plan_micro_batches(lengths, world_size=world_size, max_tokens_per_micro_batch=budget)
    assert plan == plan_micro_batches(
        torch.tensor(lengths), world_size=world_size, max_tokens_per_micro_batch=budget
    )
    # Every trajectory exactly once, with its own length; every rank has at least one.
    seen = [i for r in plan.ranks for mb in r.micro_batches for i in mb.indices]
    assert sorted(seen) == list(range(len(lengths)))
    assert all(
        mb.lengths == tuple(lengths[i] for i in mb.indices) for r in plan.ranks for mb in r.micro_batches
    )
    assert [r.rank for r in plan.ranks] == list(range(world_size)) and all(r.indices for r in plan.ranks)
    # Balance: the most loaded rank exceeds the least loaded by at most the longest trajectory.
    # (Greedy: the last row put on the heaviest rank went to the then-lightest one.)
    loads = plan.rank_tokens
    assert max(loads) - min(loads) <= max(lengths)
    for r in plan.ranks:
        mbs = r.micro_batches
        if budget is None:
            assert len(mbs) == 1
            continue
        for mb in mbs:
            # The budget holds, except for a lone trajectory longer than it (and every such one is alone).
            assert mb.num_tokens <= budget or (mb.over_budget and mb.num_sequences == 1)
            assert mb.over_budget == (mb.num_tokens > budget)
        # First fit: a later micro-batch's rows did not fit into any earlier one, so any two together
        # exceed the budget (hence at most one is half full or less).
        for a, b in itertools.combinations(mbs, 2):
            assert a.num_tokens + b.num_tokens > budget


def _optimal_makespan(lengths: list[int], world_size: int) -> int:
    return min(
        max(sum(n for n, r in zip(lengths, ranks) if r == k) for k in range(world_size))
        for ranks in itertools.product(range(world_size), repeat=len(lengths))
    )


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 50), min_size=3, max_size=7), world_size=st.integers(2, 3))
def test_lpt_within_graham_bound_of_optimal(lengths: list[int], world_size: int) -> None:
    """LPT's heaviest rank <= (4/3 - 1/(3W)) x the best assignment's (Graham 1969), checked by brute force."""
    if len(lengths) < world_size:
        return
    got = max(plan_micro_batches(lengths, world_size=world_size).rank_tokens)
    best = _optimal_makespan(lengths, world_size)
    assert got * 3 * world_size <= (4 * world_size - 1) * best


# ---------------------------------------------------------------------------------------------------
# Packing
def test_pack_rows_exact() -> None:
    ids = torch.tensor([[5, 6, 7, 0], [8, 0, 0, 0], [1, 2, 3, 4]])  # [3, 4], right-padded with 0
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    packed = pack_rows(ids, mask)
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 1, 2, 3, 4]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 0, 1, 2, 3]]
    assert packed.cu_seqlens.tolist() == [0, 3, 4, 8] and packed.cu_seqlens.dtype == torch.int32
    assert (packed.max_seqlen, packed.num_sequences, packed.num_tokens) == (4, 3, 8)
    values = torch.arange(1.0, 9.0)  # [8]
    assert unpack_rows(values.unsqueeze(0), packed).tolist() == [
        [1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0], [5.0, 6.0, 7.0, 8.0]
    ]


@settings(max_examples=100, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 20), min_size=1, max_size=8),
    extra=st.integers(0, 5),
    seed=st.integers(0, 99),
)
def test_pack_unpack_round_trip(lengths: list[int], extra: int, seed: int) -> None:
    t = max(lengths) + extra
    ids = torch.randint(1, 1000, (len(lengths), t), generator=torch.Generator().manual_seed(seed))  # [S, T]
    mask = torch.arange(t).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)  # [S, T]
    packed = pack_rows(ids, mask)
    assert packed.input_ids.tolist() == [list(itertools.chain.from_iterable(ids[i, :n].tolist() for i, n in enumerate(lengths)))]
    assert packed.position_ids.tolist() == [list(itertools.chain.from_iterable(range(n) for n in lengths))]
    assert packed.cu_seqlens.tolist() == [0, *itertools.accumulate(lengths)]
    assert torch.equal(unpack_rows(packed.input_ids, packed), ids.masked_fill(~mask, 0))


def test_unpack_is_differentiable() -> None:
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)  # [2, 3]
    packed = pack_rows(torch.ones(2, 3, dtype=torch.long), mask)
    values = torch.zeros(1, 5, requires_grad=True)
    weights = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])  # [2, 3]; 3.0 sits on padding
    (unpack_rows(values, packed) * weights).sum().backward()
    assert values.grad.tolist() == [[1.0, 2.0, 4.0, 5.0, 6.0]]


def test_bad_packing_is_refused() -> None:
    with pytest.raises(ValueError, match=r"rows \[1\] have none"):
        pack_rows(torch.ones(2, 3, dtype=torch.long), torch.tensor([[1, 0, 0], [0, 0, 0]], dtype=torch.bool))
    with pytest.raises(ValueError, match=r"rows \[\] have none \(expected one length per row, 2; got 1\)"):
        pack_rows(torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.bool), lengths=[3])
    with pytest.raises(ValueError, match=r"\[S, T\]"):
        pack_rows(torch.ones(3, dtype=torch.long), torch.ones(3, dtype=torch.bool))
    packed = pack_rows(torch.ones(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"must be \[1, 3\] or \[3\]"):
        unpack_rows(torch.zeros(4), packed)


# ---------------------------------------------------------------------------------------------------
# Rows of a TrainBatch
def _episode(prompt_id: str, n_prompt: int, n_response: int, reward: float) -> Episode:
    return Episode(
        prompt_id=prompt_id,
        token_ids=list(range(10, 10 + n_prompt + n_response)),
        loss_mask=[False] * n_prompt + [True] * n_response,
        behavior_logprobs=[0.0] * n_prompt + [-0.5] * n_response,
        reward=reward,
        policy_versions=[len(prompt_id)],
    )


def test_gather_rows_in_order_and_trimmed() -> None:
    batch = TrainBatch.from_episodes(
        [_episode("a", 2, 4, 1.0), _episode("bb", 1, 1, 0.0), _episode("ccc", 2, 1, 0.5)], pad_token_id=0
    )
    sub = gather_rows(batch, [2, 1])
    assert sub.token_ids.tolist() == [[10, 11, 12], [10, 11, 0]]  # trimmed to 3 columns, not 6
    assert sub.loss_mask.tolist() == [[False, False, True], [False, True, False]]
    assert sub.rewards.tolist() == [0.5, 0.0] and sub.policy_versions.tolist() == [3, 2]
    assert sub.prompt_ids == ["ccc", "bb"]
    with pytest.raises(ValueError, match=r"in \[0, 3\)"):
        gather_rows(batch, [3])
    with pytest.raises(ValueError, match="at least one row"):
        gather_rows(batch, [])


# ---------------------------------------------------------------------------------------------------
# End to end: the micro-batched, packed update equals the one-pass padded update
def test_micro_batched_packed_gradient_equals_full_batch(batch: TrainBatch, tiny_llama_path: str) -> None:
    """Two simulated ranks, a 25-token budget: summing every micro-batch's gradient (what backward per
    micro-batch, then one all-reduce SUM, computes) gives the full batch's gradient, provided each
    micro-batch's loss uses the GLOBAL advantages and the GLOBAL B."""
    from transformers import AutoModelForCausalLM

    from flashrl.algorithms.flash_reinforce.loss import flash_reinforce_loss
    from flashrl.models import compute_packed_token_logprobs, compute_token_logprobs

    # float64, so that the only differences left are summation order (float32 leaves 2e-5 of the tied
    # embedding's largest gradient entry).
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float64).eval()
    b = batch.batch_size
    advantages = batch.rewards - batch.rewards.mean()  # [B] batch-mean baseline, on the whole batch
    delta = 0.002  # rejects some trajectories (the fixture's drift grows with the index), keeps others

    def loss_of(rows: TrainBatch, logprobs: torch.Tensor, index: list[int]):
        return flash_reinforce_loss(
            logprobs, rows.behavior_logprobs, rows.rewards, rows.loss_mask, delta=delta,
            advantages=advantages[index], num_trajectories=b,
        )

    model.zero_grad(set_to_none=True)
    logprobs, _ = compute_token_logprobs(model, batch.token_ids, batch.attention_mask)  # [B, T]
    full = loss_of(batch, logprobs, list(range(b)))
    full.loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert 0 < int(full.trust_mask.sum()) < b

    plan = plan_micro_batches(batch.attention_mask.sum(-1), world_size=2, max_tokens_per_micro_batch=25)
    micro = [mb for r in plan.ranks for mb in r.micro_batches]
    assert len(micro) >= 3 and all(mb.num_tokens <= 25 for mb in micro)
    model.zero_grad(set_to_none=True)
    total = 0.0
    for mb in micro:
        rows = gather_rows(batch, mb.indices)
        packed = pack_rows(rows.token_ids, rows.attention_mask)
        lp, _ = compute_packed_token_logprobs(model, packed.input_ids, packed.position_ids)  # [1, N]
        out = loss_of(rows, unpack_rows(lp, packed), list(mb.indices))
        out.loss.backward()  # gradients accumulate over micro-batches; one optimizer step would follow
        total += float(out.loss.detach())
        torch.testing.assert_close(out.trust_mask, full.trust_mask[list(mb.indices)], rtol=0, atol=0)
    assert total == pytest.approx(float(full.loss.detach()), rel=1e-12, abs=1e-14)
    for n, p in model.named_parameters():
        scale = float(ref[n].abs().max())
        assert scale > 0 and float((p.grad - ref[n]).abs().max()) <= 1e-10 * scale, n
    model.zero_grad(set_to_none=True)
