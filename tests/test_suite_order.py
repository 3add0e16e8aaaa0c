"""The suite's order (tests/conftest.py): the tests marked `slow` are collected first, so the
parallel pass's workers end on short tests instead of one standing idle while the other finishes
a long one (scripts/suite_profile.py measured 15 s of such a tail)."""

from __future__ import annotations


def test_the_slow_tests_come_first(request):
    slow = [item.get_closest_marker("slow") is not None for item in request.session.items]
    assert slow == sorted(slow, reverse=True), [item.nodeid for item, s in zip(request.session.items, slow) if s][-3:]
