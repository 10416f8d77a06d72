"""`Episode.segment_starts`: where each context of a multi-segment episode starts, checked at construction."""

import pytest

from flashrl.episode import Episode


def _episode(starts, mask=(False, False, True, False, True, True)):
    n = len(mask)
    return Episode(prompt_id="p", token_ids=list(range(n)), loss_mask=list(mask), behavior_logprobs=[0.0] * n,
                   reward=1.0, segment_starts=starts)


def test_one_context_by_default():
    episode = _episode(None)
    assert episode.segments == [slice(0, 6)]


def test_segments_cover_the_tokens_in_order():
    episode = _episode([0, 3])
    assert episode.segments == [slice(0, 3), slice(3, 6)]
    assert sum(s.stop - s.start for s in episode.segments) == len(episode.token_ids)


@pytest.mark.parametrize("starts", [[], [1], [0, 0], [0, 3, 2], [0, 6], [0, 2]])
def test_bad_starts_are_refused(starts):
    # [0, 2]: position 2 is a sampled token, and a segment must open with context (a prompt token)
    with pytest.raises(ValueError, match="segment_starts"):
        _episode(starts)
