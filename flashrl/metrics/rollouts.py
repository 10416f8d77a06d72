"""Rollout dumps: sampled episodes of a training batch as JSONL, and their readable form (`flashrl show`).

``.reporting(rollout_dump_every=N, rollout_dump_count=K)`` writes, every N iterations, the first K
episodes of the batch (arrival order) to ``<TensorBoard folder>/rollouts/iteration_<N>.jsonl``, one
JSON object per episode (`rollout_record`):

- ``iteration``, ``learner_version`` (after the update), ``batch_index``, ``prompt_id``;
- ``prompt``: the prompt's text (chat template included, as the model saw it);
- ``turns``: ``{"role": "model" | "environment", "text", "num_tokens"}`` in order, a model turn with
  its ``policy_version`` (an environment turn's text includes the chat template around its message);
- ``closing``: the chat template's end of the last model turn that the model did not sample ("" if none);
- ``reward``, ``success``, ``terminated``, ``truncated``, ``termination`` (`termination_reason`),
  ``info`` (the last step's, non-JSON values as their ``str``);
- ``policy_versions``, ``policy_lag`` (versions behind the learner that trained it);
- ``drift`` and ``accepted`` (the learner's per-trajectory trust-region drift and decision, None when
  the update was skipped), ``update_applied``;
- ``num_tokens``, ``num_generated_tokens``.

Texts are decoded token-exactly (special tokens kept), so a dump shows what the model was trained on.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from flashrl.episode import Episode
from flashrl.metrics.episodes import termination_reason
from flashrl.terminal_text import escape_terminal

ROLLOUT_FOLDER = "rollouts"


def rollout_path(folder: str | os.PathLike[str], iteration: int) -> str:
    """Where the dump of ``iteration`` goes under ``folder`` (the run's TensorBoard folder)."""
    return os.path.join(os.fspath(folder), ROLLOUT_FOLDER, f"iteration_{iteration:06d}.jsonl")


def segments(episode: Episode) -> list[tuple[str, list[int]]]:
    """(role, token ids) spans of ``episode`` in order: ``prompt``, then ``model`` / ``environment``, and
    a last ``closing`` span when unsampled tokens follow the last model turn.

    A model span is a run of sampled tokens (``loss_mask`` True); what lies between two is the
    environment's turn with the chat template around it. After the last model turn come only the
    template's closing tokens (an env message is followed by a model turn, or it was not added:
    `flashrl.conversation.TokenizedConversation`).
    """
    out: list[tuple[str, list[int]]] = []
    for token, sampled in zip(episode.token_ids, episode.loss_mask):
        role = "model" if sampled else ("prompt" if not out or out[-1][0] == "prompt" else "environment")
        if out and out[-1][0] == role:
            out[-1][1].append(token)
        else:
            out.append((role, [token]))
    if len(out) > 1 and out[-1][0] == "environment":
        out[-1] = ("closing", out[-1][1])
    return out


def _json_safe(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def rollout_record(
    episode: Episode,
    *,
    decode: Any,
    iteration: int,
    learner_version: int,
    batch_index: int,
    policy_lag: int,
    learner_metrics: Mapping[str, Any],
) -> dict[str, Any]:
    """One episode's dump line (see the module docstring); ``decode`` maps token ids to text."""
    spans = segments(episode)
    prompt = decode(spans[0][1]) if spans and spans[0][0] == "prompt" else ""
    turns = []
    model_turns = [ids for role, ids in spans if role == "model"]
    versions = episode.policy_versions if len(model_turns) == len(episode.policy_versions) else None
    k = 0
    for role, ids in spans:
        if role in ("prompt", "closing"):
            continue
        turn: dict[str, Any] = {"role": role, "text": decode(ids), "num_tokens": len(ids)}
        if role == "model":
            turn["policy_version"] = versions[k] if versions is not None else None
            k += 1
        turns.append(turn)
    drifts, accepted = learner_metrics.get("drift_values"), learner_metrics.get("accepted_values")
    return {
        "iteration": iteration,
        "learner_version": learner_version,
        "batch_index": batch_index,
        "prompt_id": episode.prompt_id,
        "prompt": prompt,
        "turns": turns,
        "closing": decode(spans[-1][1]) if spans and spans[-1][0] == "closing" else "",
        "reward": episode.reward,
        "success": episode.success,
        "terminated": episode.terminated,
        "truncated": episode.truncated,
        "termination": termination_reason(episode),
        "info": _json_safe(episode.info),
        "policy_versions": list(episode.policy_versions),
        "policy_lag": policy_lag,
        "drift": float(drifts[batch_index]) if drifts is not None and batch_index < len(drifts) else None,
        "accepted": bool(accepted[batch_index]) if accepted is not None and batch_index < len(accepted) else None,
        "update_applied": bool(learner_metrics.get("applied", 0.0)),
        "num_tokens": len(episode.token_ids),
        "num_generated_tokens": episode.num_generated_tokens,
    }


def write_rollouts(path: str | os.PathLike[str], records: Sequence[Mapping[str, Any]]) -> str:
    """Write ``records`` as JSONL (one object per line) to ``path``, atomically; returns the path."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(record, default=str) + "\n" for record in records)
    os.replace(tmp, path)
    return path


def read_rollouts(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a dump (or any JSONL of objects); ValueError / TypeError name a line that is not one."""
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: expected one JSON object per line ({err}).") from err
            if not isinstance(record, dict):
                raise TypeError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}.")
            records.append(record)
    return records


def format_rollout(record: Mapping[str, Any]) -> str:
    """A dump record as readable text: a header, the prompt, each turn by role, then the info.

    For a terminal: the model's and the tools' text has its terminal controls escaped
    (``flashrl.terminal_text``), so a sampled OSC 52 sequence shows as ``\\x1b]52;...`` and does nothing.
    """

    def num(key: str, spec: str) -> str:
        value = record.get(key)
        return "-" if value is None else format(value, spec)

    header = (
        f"iteration {record.get('iteration', '-')} | batch index {record.get('batch_index', '-')} | "
        f"prompt {record.get('prompt_id', '-')} | reward {num('reward', '.3f')} | success "
        f"{record.get('success', '-')} | {record.get('termination', '-')}\n"
        f"policy versions {record.get('policy_versions', [])} (lag {record.get('policy_lag', '-')}) | drift "
        f"{num('drift', '.3e')} | accepted {record.get('accepted', '-')} | tokens "
        f"{record.get('num_tokens', '-')} ({record.get('num_generated_tokens', '-')} generated)"
    )
    parts = [header, "", "=== prompt ===", str(record.get("prompt", ""))]
    for i, turn in enumerate(record.get("turns", []), 1):
        role = turn.get("role", "?")
        version = f", policy v{turn['policy_version']}" if turn.get("policy_version") is not None else ""
        parts += ["", f"=== turn {i}: {role}{version} ({turn.get('num_tokens', '?')} tokens) ===", str(turn.get("text", ""))]
    if record.get("closing"):
        parts += ["", "=== closing (chat template, not sampled) ===", str(record["closing"])]
    parts += ["", "=== info ===", json.dumps(record.get("info", {}), indent=2, sort_keys=True, default=str)]
    return escape_terminal("\n".join(parts))
