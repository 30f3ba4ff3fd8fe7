"""Which windows get the causal effects (SPEC §9, engine/effect_spread.py): N windows spread over
the run's replicate groups, the k-th from a group holding fewer than ceil(k / 8) of them (at most
ceil(N / 8) in a group), so that their intervals rest on 8 groups wherever the corpus has them,
in one order whatever N is; a corpus that ends first goes on by rank in the group. Known
answers on hand-made groups."""

from __future__ import annotations

import random

from headatlas.service.engine.effect_spread import group_cap, spread

# --- known answers --------------------------------------------------------------------------------


def _items(groups: str) -> list[tuple[int, str]]:
    """(position, group) of hand-made windows: one letter a window, its group."""
    return list(enumerate(groups))


def _spread(groups: str, count: int) -> list[int]:
    items = _items(groups)
    return [p for p, _g in spread(lambda: iter(items), lambda item: ord(item[1]), count)]


def test_the_kth_window_is_taken_from_a_group_holding_fewer_than_k_over_8() -> None:
    assert [group_cap(n) for n in (1, 8, 9, 16, 17, 64)] == [1, 1, 2, 2, 3, 8]
    # 8 windows: one of each group, in corpus order, the rest of a group passed over
    assert _spread("AAAABBBCDDEFFGHHII", 8) == [0, 4, 7, 8, 10, 11, 13, 14]
    # 16 windows: one of each of 8 groups, then the waiting second ones of A, B, D, F (earliest
    # first), then H's second, I's and J's (K is never reached: 16 are taken by then)
    assert _spread("AAAABBBCDDEFFGHHIIJJKK", 16) == [0, 1, 4, 5, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]
    # the first N by position would have been AAAABBBC: 3 groups
    assert len({"AAAABBBCDDEFFGHHII"[p] for p in _spread("AAAABBBCDDEFFGHHII", 8)}) == 8


def test_a_corpus_that_ends_first_is_filled_level_by_level_in_corpus_order() -> None:
    # 4 windows, 2 groups: one each, then those waiting by their rank in the group (A's 2nd, 3rd)
    assert _spread("AAAAAB", 4) == [0, 1, 2, 5]
    # 5: one each, then the 2nd of A and of B, then A's 3rd (earlier than B's)
    assert _spread("AAAAABBBB", 5) == [0, 1, 2, 5, 6]
    assert _spread("AAAAABBBB", 8) == [0, 1, 2, 3, 5, 6, 7, 8]
    assert _spread("ABAB", 8) == [0, 1, 2, 3]  # no more windows than asked: all of them
    assert _spread("AAA", 0) == []
    walks = []

    def walk():
        walks.append(1)
        return iter(_items("AABBCCDDEEFFGGHH"))

    spread(walk, lambda item: ord(item[1]), 8)
    assert len(walks) == 1  # N taken straight from the walk: one walk, stopped there
    walks.clear()
    spread(walk, lambda item: ord(item[1]), 9)
    assert len(walks) == 2  # the 9th is A's second, which waited: read again


def test_the_windows_for_n_are_among_those_for_more() -> None:
    """What ``effects RUN --windows`` relies on: asked for more, a run measures only the new ones."""
    rng = random.Random(0)
    for _ in range(200):
        groups = "".join(rng.choice("ABCDEFGHIJKLMNOP"[: rng.randint(1, 16)]) for _ in range(rng.randint(1, 80)))
        smaller = rng.randint(1, 40)
        larger = smaller + rng.randint(1, 40)
        assert set(_spread(groups, smaller)) <= set(_spread(groups, larger)), (groups, smaller, larger)
        assert len(_spread(groups, smaller)) == min(smaller, len(groups))
