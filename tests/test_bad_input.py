"""Bad input rejected where it enters, with an error that names it: watch(max_frames=...) out
of range. (Sink constructors: test_prometheus_sink.py, test_jsonl.py; event logs:
test_cli_report_diff.py.)"""

from __future__ import annotations

import pytest
import torch

import tensorwatch_otel as tw
from tensorwatch_otel.core.config import MAX_FRAMES_LIMIT, ConfigError, WatchConfig


def _model():
    return torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU())


def _no_hooks(model) -> bool:
    return not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


@pytest.mark.parametrize("bad", [10**9, MAX_FRAMES_LIMIT + 1])
def test_max_frames_above_the_limit(bad):
    model = _model()
    with pytest.raises(ConfigError, match=rf"^max_frames={bad}: expected an integer from 1 to 100000"):
        tw.watch(model, sinks=[], max_frames=bad)
    assert _no_hooks(model)
    with pytest.raises(ValueError, match="max_frames"):  # the drop-in takes the same bound
        tw.DebugUnderflowOverflow(model, max_frames_to_save=bad)
    assert _no_hooks(model)


def test_max_frames_at_the_limit_is_accepted():
    assert MAX_FRAMES_LIMIT == 100_000  # documented in docs/reference/options.md
    model = _model()
    with tw.watch(model, sinks=[], max_frames=MAX_FRAMES_LIMIT) as w:
        model(torch.ones(1, 3))
        assert w.batch_number == 1


def test_max_frames_from_the_environment_above_the_limit(monkeypatch):
    monkeypatch.setenv("TENSORWATCH_MAX_FRAMES", str(10**9))
    with pytest.raises(ConfigError,
                       match=r"^TENSORWATCH_MAX_FRAMES='1000000000': expected an integer from 1 to 100000"):
        WatchConfig.build()  # max_frames left at None: the variable decides
