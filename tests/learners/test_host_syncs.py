"""An update reads values back to the host a fixed number of times, however many micro-batches it runs.

Every conversion of a tensor to a Python value (``item``, ``tolist``, ``float``, ``int``, ``bool``) is
a host sync on a GPU. The learner keeps its loss, metrics and finiteness flags on the device and reads
them back once per update, so the count of those calls must not grow with the number of micro-batches.
(On these CPU tests the calls are counted, not timed: a sync costs nothing here.)

Counted: the calls made from the learner, the loss and the model code around the forward pass
(``COUNTED``). The forward's own internals are not: the chunked head's target-range check
(``flashrl.ops.logprobs``) and transformers' choice of an sdpa mask read a few values per forward pass.
"""

from __future__ import annotations

import math
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import flashrl
from flashrl.learners import Learner

CONVERSIONS = ("item", "tolist", "__float__", "__int__", "__bool__")
COUNTED = tuple(str(Path(flashrl.__file__).parent / part) for part in ("learners", "algorithms", "models"))


def _count_conversions(monkeypatch: pytest.MonkeyPatch, run) -> tuple[Counter[str], object]:
    """Run ``run()`` counting tensor-to-Python conversions called from ``COUNTED``, by caller line."""
    counts: Counter[str] = Counter()
    for name in CONVERSIONS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            caller = sys._getframe(1)
            if caller.f_code.co_filename.startswith(COUNTED):
                counts[f"{_name} {Path(caller.f_code.co_filename).name}:{caller.f_lineno}"] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    try:
        result = run()
    finally:
        monkeypatch.undo()
    return counts, result


@pytest.mark.parametrize("pack_sequences", [False, True], ids=["padded", "packed"])
def test_host_reads_per_update_do_not_grow_with_the_micro_batches(monkeypatch, make_spec, batch, pack_sequences):
    counts = {}
    for budget in (None, 20):  # one pass, then the 6 episodes (8 to 14 tokens) in 20-token passes
        learner = Learner(make_spec(optimizer="sgd", lr=1e-3, delta=0.012, max_tokens_per_micro_batch=budget,
                                    pack_sequences=pack_sequences))
        counts[budget], metrics = _count_conversions(monkeypatch, lambda learner=learner: learner.update(batch))
        assert metrics["applied"] == 1.0
        assert metrics["num_micro_batches"] == (1.0 if budget is None else 4.0)
    assert counts[20] == counts[None], (counts[None], counts[20])
    # Per update: the batch's finiteness (2 bools), the lengths for the layout (1 tolist), the
    # token count of the normaliser (prepare: 1 int), the one read-back of the skip code and the
    # metrics (1 tolist), the gradient norm's finiteness and value (1 bool, 1 float).
    assert sum(counts[None].values()) == 7, counts[None]


def test_a_skipped_batch_reads_back_as_little(monkeypatch, make_spec, batch):
    # Non-finite recomputed log-probs are found on the device: no read-back per micro-batch either.
    counts = {}
    for budget in (None, 20):
        learner = Learner(make_spec(optimizer="sgd", lr=1e-3, max_tokens_per_micro_batch=budget))
        with torch.no_grad():
            learner.model.model.norm.weight[0] = math.nan
        counts[budget], metrics = _count_conversions(monkeypatch, lambda learner=learner: learner.update(replace(batch)))
        assert metrics["skipped/non_finite_logprobs"] == 1.0 and learner.version == 0
    assert counts[20] == counts[None], (counts[None], counts[20])
