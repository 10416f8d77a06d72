"""`BatchAssembler`: the next B finished episodes of B distinct prompts, in arrival order.

The async path of `EpisodeStream` offers every delivered episode to an assembler. An episode joins the
batch unless its prompt is already in it (or the batch is full); then it waits for a later batch in a
bounded queue whose oldest episode is dropped beyond its capacity (`pending_overflow`). With a lag
bound (`async_queue_size`), an episode more than that many versions behind the learner is dropped
(`stale`). Every drop is counted in `skipped` (the stream books it), never silent.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable

from flashrl.episode import Episode
from flashrl.metrics import policy_lags


class BatchAssembler:
    """Builds one batch; what it cannot use is left in `later` (the next batch's first offers).

    Args:
        batch_size: B.
        pending_capacity: most episodes `later` holds.
        learner_version: the version that will train this batch (for the lag bound).
        max_lag: drop episodes more than this many versions behind; None = no bound.
    """

    def __init__(
        self, batch_size: int, *, pending_capacity: int, learner_version: int, max_lag: int | None = None
    ) -> None:
        self.batch_size = int(batch_size)
        self.pending_capacity = int(pending_capacity)
        self.learner_version = int(learner_version)
        self.max_lag = max_lag
        self.batch: list[Episode] = []
        self.prompts: set[str] = set()
        self.later: deque[Episode] = deque()
        self.skipped: Counter[str] = Counter()
        """Dropped episodes by reason, not yet booked (`take_skipped()`)."""
        self.repeated = 0
        """Episodes that waited because their prompt was already in the batch."""

    @property
    def full(self) -> bool:
        return len(self.batch) >= self.batch_size

    def offer(self, episode: Episode) -> None:
        if self.max_lag is not None and policy_lags(self.learner_version, [episode.min_policy_version])[0] > self.max_lag:
            self.skipped["stale"] += 1
        elif not self.full and episode.prompt_id not in self.prompts:
            self.batch.append(episode)
            self.prompts.add(episode.prompt_id)
        else:  # a repeated prompt or an overflow: it opens a later batch
            self.repeated += episode.prompt_id in self.prompts
            self.later.append(episode)
            if len(self.later) > self.pending_capacity:
                self.later.popleft()
                self.skipped["pending_overflow"] += 1

    def offer_all(self, episodes: Iterable[Episode]) -> None:
        for episode in episodes:
            self.offer(episode)

    def take_skipped(self) -> Counter[str]:
        """The drops since the last call (to book them)."""
        taken, self.skipped = self.skipped, Counter()
        return taken

    def blocked(self, prompts: set[str] | None = None) -> int:
        """Waiting episodes that cannot join a batch holding `prompts` (default: this batch's).

        Their prompt is in it or repeats an earlier waiting episode's; the admission budget does not
        count them, so too few distinct finished episodes never deadlock the stream.
        """
        seen, n = set(self.prompts if prompts is None else prompts), 0
        for episode in self.later:
            if episode.prompt_id in seen:
                n += 1
            seen.add(episode.prompt_id)
        return n
