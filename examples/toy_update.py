"""One FlashREINFORCE update on the CPU, end to end, in a few seconds and with no downloads.

A tiny policy (a per-prompt bigram model) answers B different prompts with one trajectory each, of
different lengths (each stops at an end token), recording the log-probability of every sampled token
*at sampling time*. A simple rule scores them.
One extra trajectory is sampled from an older copy of the weights: the Sequence Trust Region rejects
it. The reference loss then drives exactly ONE optimizer step, and the script checks what the method
promises: the log-probability of every accepted positive-advantage trajectory rose, that of every
accepted negative-advantage trajectory fell. It exits non-zero otherwise.

    python examples/toy_update.py
"""

from __future__ import annotations

import copy
import sys

import torch
from torch import nn

from flashrl.algorithms.flash_reinforce.loss import flash_reinforce_loss

VOCAB, EOS, MAX_LEN, B, DELTA, LR, SEED = 12, 0, 14, 8, 0.05, 0.5, 0


class TinyPolicy(nn.Module):
    """Per-prompt bigram model: logits[prompt, previous token, next token]; token 0 ends a trajectory.

    Different prompts share no parameters, so one update moves each trajectory's probability only
    through its own term of the loss: exactly what the per-trajectory check below can rely on.
    """

    def __init__(self, num_prompts: int) -> None:
        super().__init__()
        self.logits = nn.Parameter(0.5 * torch.randn(num_prompts, VOCAB + 1, VOCAB))  # id VOCAB = start

    def forward(self, prompts: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """Log-probs [B, T, V] of the next token given prompt ids [B] and previous tokens [B, T]."""
        return torch.log_softmax(self.logits[prompts[:, None], previous], -1)


@torch.no_grad()
def sample(policy: TinyPolicy, prompt: int, generator: torch.Generator) -> tuple[list[int], list[float]]:
    """Sample one trajectory; return its tokens and the behavior log-prob recorded for each."""
    tokens, logprobs, previous = [], [], VOCAB
    for _ in range(MAX_LEN):
        logp = torch.log_softmax(policy.logits[prompt, previous], -1)  # [V]
        token = int(torch.multinomial(logp.exp(), 1, generator=generator))
        tokens.append(token)
        logprobs.append(float(logp[token]))  # recorded now, never recomputed later
        if token == EOS:
            break
        previous = token
    return tokens, logprobs


def reward(tokens: list[int]) -> float:
    """1 when the trajectory has more even than odd non-end tokens, else 0."""
    body = [t for t in tokens if t != EOS]
    return float(sum(t % 2 == 0 for t in body) > sum(t % 2 == 1 for t in body))


def current_logprobs(policy: TinyPolicy, trajectories: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Current-policy log-probs [B, T] of the sampled tokens and the valid-token mask [B, T]."""
    t_max = max(len(t) for t in trajectories)
    previous = torch.full((len(trajectories), t_max), EOS)
    targets = torch.full((len(trajectories), t_max), EOS)
    mask = torch.zeros(len(trajectories), t_max, dtype=torch.bool)
    for i, traj in enumerate(trajectories):
        previous[i, : len(traj)] = torch.tensor([VOCAB] + traj[:-1])
        targets[i, : len(traj)] = torch.tensor(traj)
        mask[i, : len(traj)] = True
    prompts = torch.arange(len(trajectories))
    logp = policy(prompts, previous).gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [B, T]
    return logp, mask


def main() -> int:
    torch.manual_seed(SEED)
    generator = torch.Generator().manual_seed(SEED)
    policy = TinyPolicy(num_prompts=B)

    # An older policy: the weights a few updates ago (here: a perturbed copy).
    stale_policy = copy.deepcopy(policy)
    with torch.no_grad():
        for p in stale_policy.parameters():
            p.add_(1.0 * torch.randn_like(p))

    trajectories, behavior, sources = [], [], []
    for prompt in range(B - 1):  # one rollout per prompt
        tokens, lps = sample(policy, prompt, generator)
        trajectories.append(tokens)
        behavior.append(lps)
        sources.append("current")
    tokens, lps = sample(stale_policy, B - 1, generator)  # the last prompt, answered by old weights
    trajectories.append(tokens)
    behavior.append(lps)
    sources.append("stale")

    rewards = torch.tensor([reward(t) for t in trajectories])
    if rewards.min() == rewards.max():
        print("All rewards are equal: no learning signal in this batch; change SEED.")
        return 1

    logq, mask = current_logprobs(policy, trajectories)
    behavior_t = torch.zeros_like(logq)
    for i, lps in enumerate(behavior):
        behavior_t[i, : len(lps)] = torch.tensor(lps)

    out = flash_reinforce_loss(logq, behavior_t, rewards, mask, delta=DELTA)
    optimizer = torch.optim.SGD(policy.parameters(), lr=LR)
    optimizer.zero_grad()
    out.loss.backward()
    optimizer.step()  # exactly one step; the batch is then discarded

    with torch.no_grad():
        logq_after, _ = current_logprobs(policy, trajectories)
    before = (logq.detach() * mask).sum(-1)  # [B] trajectory log-probability
    after = (logq_after * mask).sum(-1)  # [B]

    print(f"FlashREINFORCE toy update: B = {B}, delta = {DELTA}, one SGD step (lr = {LR})")
    print(f"{'#':>2} {'source':>8} {'reward':>6} {'adv':>7} {'len':>4} {'drift':>9} {'accepted':>8} "
          f"{'logp before':>12} {'logp after':>11} {'check':>6}")
    failures = []
    for i in range(B):
        adv, accepted = float(out.advantages[i]), bool(out.trust_mask[i])
        delta_lp = float(after[i] - before[i])
        if not accepted:
            verdict = "n/a"
        elif adv > 0:
            verdict = "up" if delta_lp > 0 else "FAIL"
        elif adv < 0:
            verdict = "down" if delta_lp < 0 else "FAIL"
        else:
            verdict = "n/a"
        if verdict == "FAIL":
            failures.append(i)
        print(f"{i:>2} {sources[i]:>8} {float(rewards[i]):>6.1f} {adv:>+7.3f} {int(mask[i].sum()):>4} "
              f"{float(out.drift[i]):>9.2e} {accepted!s:>8} {float(before[i]):>12.4f} {float(after[i]):>11.4f} "
              f"{verdict:>6}")
    print(f"loss = {out.loss.item():.6f}; accepted fraction = {out.metrics['accepted_fraction']:.3f}")

    stale_rejected = not bool(out.trust_mask[sources.index("stale")])
    fresh_accepted = all(bool(out.trust_mask[i]) for i, s in enumerate(sources) if s == "current")
    ok = not failures and stale_rejected and fresh_accepted
    if not stale_rejected:
        print("FAIL: the stale trajectory was not rejected by the trust region.")
    if not fresh_accepted:
        print("FAIL: a trajectory sampled from the current weights was rejected.")
    if failures:
        print(f"FAIL: trajectories {failures} moved against the sign of their advantage.")
    print("OK: one update moved every accepted trajectory in the direction of its advantage." if ok else "")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
