"""The task order of the finite-list environments (``flashrl.envs.task_order``), shared by Math and ALFWorld."""

from __future__ import annotations

import numpy as np
import pytest

from flashrl.envs.task_order import EpochCursor, check_order


def _draws(cursor: EpochCursor, n: int, order: str, rng: np.random.Generator, k: int) -> list[int]:
    return [cursor.next_index(n, order, rng) for _ in range(k)]


def test_sequential_walks_the_list_and_wraps() -> None:
    assert _draws(EpochCursor(), 3, "sequential", np.random.default_rng(0), 7) == [0, 1, 2, 0, 1, 2, 0]


def test_shuffle_draws_a_new_permutation_each_epoch() -> None:
    # default_rng(0).permutation(3) gives [2, 0, 1], then [2, 1, 0]
    assert _draws(EpochCursor(), 3, "shuffle", np.random.default_rng(0), 6) == [2, 0, 1, 2, 1, 0]


def test_restart_begins_a_new_epoch_mid_way() -> None:
    cursor, rng = EpochCursor(), np.random.default_rng(0)
    assert _draws(cursor, 3, "shuffle", rng, 1) == [2]
    cursor.restart()
    # without the restart the next draws would finish [2, 0, 1]; after it a fresh permutation starts
    assert _draws(cursor, 3, "shuffle", rng, 3) == [2, 1, 0]
    cursor.restart()
    assert _draws(cursor, 3, "sequential", rng, 2) == [0, 1]


def test_random_draws_with_replacement_and_leaves_the_cursor() -> None:
    cursor = EpochCursor()
    assert _draws(cursor, 5, "random", np.random.default_rng(0), 4) == [4, 3, 2, 1]
    assert _draws(cursor, 5, "sequential", np.random.default_rng(0), 1) == [0]


def test_an_unknown_order_says_what_is_expected() -> None:
    with pytest.raises(ValueError, match=r"order must be 'shuffle', 'random' or 'sequential'; got 'cyclic'\."):
        check_order("cyclic")
    check_order("shuffle")
