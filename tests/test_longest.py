"""``cache_backends.layout.longest``: the one bisection the KV planners share (layout, slab arena, ``max_seq_len:
auto``, V2's fits), against a linear scan."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from cache_backends.layout import longest


@given(st.integers(-3, 300), st.integers(-3, 300), st.integers(0, 320))
def test_longest_is_the_largest_fitting_length_a_linear_scan_finds(least, most, edge):
    """``fits`` true up to ``edge``: the answer is the largest n in [least, most] at or below it, ``least`` when
    none above ``least`` fits; ``fits`` is asked only inside ``(least, most]``."""
    asked: list[int] = []

    def fits(n: int) -> bool:
        asked.append(n)
        return n <= edge

    scan = max((n for n in range(least + 1, most + 1) if n <= edge), default=least)
    assert longest(fits, most, least) == scan
    assert all(least < n <= most for n in asked)
    assert len(asked) <= max(0, most - least).bit_length()  # a bisection, not a scan


def test_longest_asks_nothing_of_an_empty_range_and_reads_nothing_fits_as_its_lower_end():
    def never_asked(n: int) -> bool:
        raise AssertionError(f"fits({n}) asked")

    assert (longest(never_asked, 0), longest(never_asked, -5), longest(never_asked, 4, 4)) == (0, 0, 4)
    assert (longest(lambda n: False, 100), longest(lambda n: True, 100)) == (0, 100)
    assert (longest(lambda n: n <= 7, 5, 3), longest(lambda n: n <= 2, 5, 3)) == (5, 3)
