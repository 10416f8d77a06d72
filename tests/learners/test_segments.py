"""Episodes of several segments: the batch carries them, the learner scores each on its own context.

A segment is a sequence the model saw from its own start (an agent that edited its conversation).
The reference scores every segment alone with a plain float64 forward of the tiny model, concatenates
the per-token log-probs per episode, and applies the loss; the learner must give the same loss and
gradient, padded or packed, in one pass or in micro-batches.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from flashrl.algorithms.flash_reinforce.loss import flash_reinforce_loss
from flashrl.episode import Episode
from flashrl.learners import Learner, MicroBatch, TrainBatch
from flashrl.learners.packing import gather_rows, pack_rows
from flashrl.learners.segments import from_segments, split_segments, to_segments

PAD = 0
LAYOUTS = [[(3, 4), (2, 3)], [(4, 5)], [(2, 3), (3, 2), (2, 4)], [(3, 6)], [(2, 2), (4, 3)]]
"""Per episode, the (prompt, response) token counts of each of its segments."""
REWARDS = [1.0, 0.0, 0.5, 0.0, 1.0]


def _alone(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """[n] float64 log-prob of each token of ``ids`` given the earlier ones, scored alone; 0 at the first."""
    x = torch.tensor([ids])  # [1, n]
    logits = model(input_ids=x).logits[0, :-1].double()  # [n-1, V] a plain forward, positions from 0
    picked = torch.log_softmax(logits, dim=-1).gather(-1, x[0, 1:, None]).squeeze(-1)  # [n-1]
    return torch.cat([picked.new_zeros(1), picked])  # [n]


def _segments(model_path: str, *, seed: int = 0, noise: float = 0.002) -> tuple[list[Episode], list[list[list[int]]]]:
    """Episodes of ``LAYOUTS``: random tokens, behavior = each segment scored alone, mixed towards 1/2.

    Episode ``i``'s recorded probabilities are mixed towards 1/2 with weight ``i * noise``, so its drift
    grows with ``i``. Returns the episodes and, per episode, the token ids of each segment.
    """
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64).eval()
    gen = torch.Generator().manual_seed(seed)
    episodes, all_segments = [], []
    for i, layout in enumerate(LAYOUTS):
        segments = [torch.randint(1, model.config.vocab_size, (p + r,), generator=gen).tolist() for p, r in layout]
        w = i * noise
        ids, mask, behavior, starts = [], [], [], []
        for (p, r), seg in zip(layout, segments):
            with torch.no_grad():
                q = _alone(model, seg)[p:]  # [r]
            starts.append(len(ids))
            ids += seg
            mask += [False] * p + [True] * r
            behavior += [0.0] * p + torch.log((1 - w) * q.exp() + w * 0.5).tolist()
        episodes.append(Episode(prompt_id=f"e{i}", token_ids=ids, loss_mask=mask, behavior_logprobs=behavior,
                                reward=REWARDS[i], segment_starts=starts if len(starts) > 1 else None))
        all_segments.append(segments)
    return episodes, all_segments


@pytest.fixture(scope="module")
def segmented(tiny_llama_path: str) -> tuple[TrainBatch, list[list[list[int]]]]:
    episodes, segments = _segments(tiny_llama_path)
    return TrainBatch.from_episodes(episodes, pad_token_id=PAD), segments


def _weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


# --------------------------------------------------------------------------------------------------
# The learner against the float64 reference
@pytest.mark.parametrize(
    "options",
    [{"pack_sequences": False}, {"pack_sequences": True},
     {"pack_sequences": False, "max_tokens_per_micro_batch": 20},
     {"pack_sequences": True, "max_tokens_per_micro_batch": 20}],
    ids=["padded", "packed", "padded_micro", "packed_micro"],
)
def test_update_matches_the_float64_reference_scored_segment_by_segment(make_spec, tiny_llama_path, segmented,
                                                                        options):
    batch, segments = segmented
    delta, lr = 0.015, 1e-2
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float64).eval()
    rows = [torch.cat([_alone(model, seg) for seg in episode]) for episode in segments]  # [n_i] each
    logq = torch.zeros(batch.token_ids.shape, dtype=torch.float64)  # [B, T]
    logq = logq.index_put((torch.cat([torch.full((len(r),), i) for i, r in enumerate(rows)]),
                           torch.cat([torch.arange(len(r)) for r in rows])), torch.cat(rows))
    behavior, mask = batch.behavior_logprobs.double(), batch.loss_mask  # [B, T]
    ref = flash_reinforce_loss(logq, behavior, batch.rewards.double(), mask, delta=delta)
    assert ref.trust_mask.tolist() == [True, True, True, False, False]  # drift grows with the index
    ref.loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}

    # The surrogate written out: -(1/B) sum_i trust_i A_i / T_i sum_t sg(rho_it) log q_it over ALL of
    # episode i's sampled tokens, across its segments.
    q = logq.detach()
    advantages = batch.rewards.double() - batch.rewards.double().mean()  # [B]
    per_episode = ((q - behavior).exp() * q * mask).sum(-1) / mask.sum(-1)  # [B]
    surrogate = -float((ref.trust_mask * advantages * per_episode).sum()) / batch.batch_size
    assert float(ref.loss.detach()) == pytest.approx(surrogate, rel=1e-12)

    learner = Learner(make_spec(dtype="float64", optimizer="sgd", lr=lr, delta=delta, **options))
    before = _weights(learner.model)
    metrics = learner.update(batch)
    assert metrics["applied"] == 1.0 and metrics["accepted_fraction"] == pytest.approx(0.6)
    assert metrics["loss"] == pytest.approx(surrogate, rel=1e-9)
    if "max_tokens_per_micro_batch" in options:
        assert metrics["num_micro_batches"] >= 3
    for name, p in learner.model.named_parameters():
        step = (before[name] - p.detach()) / lr
        torch.testing.assert_close(step, grads[name], rtol=1e-7, atol=1e-10)
    assert max(float(g.abs().max()) for g in grads.values()) > 1e-3


# --------------------------------------------------------------------------------------------------
# The learner's log-probs: a segment scores as if it were an episode of its own
@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_segments_score_like_separate_episodes(make_spec, segmented, pack):
    batch, segments = segmented
    single = [Episode(prompt_id=f"s{k}", token_ids=seg, loss_mask=[False] + [True] * (len(seg) - 1),
                      behavior_logprobs=[0.0] + [-1.0] * (len(seg) - 1), reward=0.0)
              for k, seg in enumerate(s for episode in segments for s in episode)]
    alone = TrainBatch.from_episodes(single, pad_token_id=PAD)
    assert alone.segment_positions is None

    learner = Learner(make_spec(dtype="float64", pack_sequences=pack, delta=1.0, negative_token_fraction=0.5))
    assert learner.pack_sequences is pack and learner.loss.needs_entropy

    def scores(b: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            return learner._logprobs(b, b.attention_mask.sum(-1).tolist())  # [B, T], [B, T]

    logprobs, entropy = scores(batch)
    want_logprobs, want_entropy = scores(alone)
    lengths = alone.attention_mask.sum(-1).tolist()
    k = 0
    for i, episode in enumerate(segments):
        n = sum(len(s) for s in episode)
        expected_lp = torch.cat([want_logprobs[k + j, :lengths[k + j]] for j in range(len(episode))])  # [n]
        expected_h = torch.cat([want_entropy[k + j, :lengths[k + j]] for j in range(len(episode))])  # [n]
        torch.testing.assert_close(logprobs[i, :n], expected_lp, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(entropy[i, :n], expected_h, rtol=1e-9, atol=1e-12)
        assert bool((logprobs[i, n:] == 0).all()) and bool((entropy[i, n:] == 0).all())
        k += len(episode)
    starts = [0, 7]  # episode 0's segment starts: unscored, as position 0 of a row is
    assert logprobs[0, starts].tolist() == [0.0, 0.0] and entropy[0, starts].tolist() == [0.0, 0.0]


# --------------------------------------------------------------------------------------------------
# The weights: every episode 1/B, its mean over all its sampled tokens across segments
def test_an_episode_of_two_segments_weighs_one_over_b_like_one_of_one_segment(make_spec):
    # Episode 0: segments [7, 8 | 9, 10, 11] and [12 | 13, 14] (5 sampled tokens); episode 1: one
    # segment, 4 sampled. importance_sampling="none": rho = 1. A = [0.5, -0.5], B = 2:
    # d loss / d log q = -(1/2) A_i / T_i = -0.05 per token of episode 0, +0.0625 per token of episode 1,
    # so each episode's gradient sums to -A_i / B whatever its segments and length.
    episodes = [
        Episode(prompt_id="two", token_ids=[7, 8, 9, 10, 11, 12, 13, 14],
                loss_mask=[False, False, True, True, True, False, True, True], behavior_logprobs=[-1.0] * 8,
                reward=1.0, segment_starts=[0, 5]),
        Episode(prompt_id="one", token_ids=[20, 21, 22, 23, 24], loss_mask=[False, True, True, True, True],
                behavior_logprobs=[-1.0] * 5, reward=0.0),
    ]
    batch = TrainBatch.from_episodes(episodes, pad_token_id=PAD)
    learner = Learner(make_spec(dtype="float64", importance_sampling="none", delta=math.inf, pack_sequences=False))
    context = learner.loss.prepare(batch)
    logprobs, entropy = learner._logprobs(batch, [8, 5])  # [2, 8]
    logprobs.retain_grad()
    loss, _ = learner.loss.compute_loss(MicroBatch(batch, torch.arange(2), logprobs, entropy), context)
    loss.backward()
    expected = torch.tensor([[0.0, 0.0, -0.05, -0.05, -0.05, 0.0, -0.05, -0.05],
                             [0.0, 0.0625, 0.0625, 0.0625, 0.0625, 0.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logprobs.grad, expected)
    assert logprobs.grad.sum(-1).tolist() == pytest.approx([-0.25, 0.25])
    # The second segment starts afresh: its first token is not scored, its second sees only the first.
    assert float(logprobs[0, 5].detach()) == 0.0
    with torch.no_grad():
        alone = _alone(learner.model, [12, 13, 14])  # [3]
    torch.testing.assert_close(logprobs[0, 5:].detach(), alone, rtol=1e-9, atol=1e-12)


# --------------------------------------------------------------------------------------------------
# The batch carries the segments
def _episode(prompt_id: str, tokens: int, starts: list[int] | None) -> Episode:
    mask = [t not in (starts or [0]) for t in range(tokens)]
    return Episode(prompt_id=prompt_id, token_ids=list(range(1, tokens + 1)), loss_mask=mask,
                   behavior_logprobs=[-0.5 * m for m in mask], reward=0.0, segment_starts=starts)


def test_from_episodes_fills_the_positions_and_rows_carry_them():
    batch = TrainBatch.from_episodes([_episode("a", 6, [0, 2, 5]), _episode("b", 3, None), _episode("c", 4, [0])],
                                     pad_token_id=PAD)
    expected = torch.tensor([[0, 1, 0, 1, 2, 0], [0, 1, 2, 0, 0, 0], [0, 1, 2, 3, 0, 0]])
    assert batch.segment_positions.dtype == torch.int64 and torch.equal(batch.segment_positions, expected)
    assert torch.equal(gather_rows(batch, [2, 0]).segment_positions, expected[[2, 0]])
    assert torch.equal(gather_rows(batch, [1]).segment_positions, expected[[1], :3])
    assert torch.equal(batch.rows(slice(1, 3), max_length=4).segment_positions, expected[1:, :4])
    assert torch.equal(batch.to("cpu").segment_positions, expected)
    one = TrainBatch.from_episodes([_episode("b", 3, None), _episode("c", 4, [0])], pad_token_id=PAD)
    assert one.segment_positions is None  # one segment each: the batch (and its cost) as before


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda p: p.int(), r"must be None or a \[2, 6\] int64 tensor"),
        (lambda p: p[:, :5], r"must be None or a \[2, 6\] int64 tensor"),
        (lambda p: p.index_put_((torch.tensor(1), torch.tensor(5)), torch.tensor(3)), "0 at column 0 and on padding"),
        (lambda p: p + (torch.arange(6) == 0).long(), "0 at column 0 and on padding"),
        (lambda p: p.index_put_((torch.tensor(0), torch.tensor(3)), torch.tensor(0)),
         r"restart at 0 only on a prompt token \(loss_mask False\); row 0 has 0 at column 3 after 0"),
        (lambda p: p.index_put_((torch.tensor(0), torch.tensor(4)), torch.tensor(3)),
         "row 0 has 3 at column 4 after 1"),
    ],
    ids=["dtype", "shape", "padding", "first", "restart_on_sampled", "jump"],
)
def test_a_bad_segment_field_is_refused(change, message):
    batch = TrainBatch.from_episodes([_episode("a", 6, [0, 2]), _episode("b", 3, None)], pad_token_id=PAD)
    fields = {**vars(batch), "segment_positions": change(batch.segment_positions.clone())}
    with pytest.raises(ValueError, match=f"TrainBatch.segment_positions .*{message}"):
        TrainBatch(**fields)


# --------------------------------------------------------------------------------------------------
# The pure functions
def test_split_pack_and_fold_exact():
    positions = torch.tensor([[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 0, 0]])  # [2, 6]
    mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    ids = torch.tensor([[11, 12, 13, 14, 15, 16], [21, 22, 23, 24, 0, 0]])
    split = split_segments(positions, mask)
    assert to_segments(ids, split).tolist() == [[11, 12, 0, 0], [13, 14, 15, 0], [16, 0, 0, 0], [21, 22, 23, 24]]
    values = torch.arange(16, dtype=torch.float64).reshape(4, 4).requires_grad_()  # [S, Ts]
    folded = from_segments(values, split)
    assert folded.tolist() == [[0, 1, 4, 5, 6, 8], [12, 13, 14, 15, 0, 0]]
    folded.sum().backward()
    assert values.grad.tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]]
    packed = pack_rows(ids, mask, positions=positions)
    assert packed.position_ids.tolist() == [[0, 1, 0, 1, 2, 0, 0, 1, 2, 3]]
    assert packed.cu_seqlens.tolist() == [0, 2, 5, 6, 10] and (packed.max_seqlen, packed.num_sequences) == (4, 4)
