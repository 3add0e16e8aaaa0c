"""Shared fixtures: free ports on 127.0.0.1, tiny real models."""

from __future__ import annotations

import socket

import _interpreted  # noqa: F401  (first: Triton's interpreter is chosen before anything imports Triton)
import pytest


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.hookimpl(tryfirst=True)  # (before xdist's own hook reads the groups)
def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    """The tests marked `slow` first, each group in its collection order (the same in every
    worker): the parallel pass (scripts/test.sh) then ends on short tests, not with one worker
    idle while the other finishes a compile (a 15 s tail, scripts/suite_profile.py).

    The tests marked `timing` in two xdist groups, for the timing pass's two workers
    (`--dist loadgroup`): those also marked `waits` (waits for an exporter's timeout or a
    linger, in-process or in one child process: little CPU) on one, the others one at a time
    on the other, so that a test that runs processes side by side or loads the cores never has
    another such test beside it."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    if not config.pluginmanager.hasplugin("xdist"):  # (the minimum-versions job runs without it)
        return
    for item in items:
        if item.get_closest_marker("timing") is not None:
            waits = item.get_closest_marker("waits") is not None
            item.add_marker(pytest.mark.xdist_group("timing-waits" if waits else "timing-alone"))
