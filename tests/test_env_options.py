"""watch() options from TENSORWATCH_* variables: argument, then variable, then default; bad values
name the variable and the valid range; the drop-in keeps the peer's own defaults; every variable
is one constant of core/env.py and is documented."""

from __future__ import annotations

import os
import re

import pytest
import torch

from _collect import Collect
from _otel_fixtures import OverflowNet
from tensorwatch_otel import DebugUnderflowOverflow, NonFiniteDetected, NonFiniteEvent, watch
from tensorwatch_otel.core import env as twenv
from tensorwatch_otel.core.config import DEFAULTS, ConfigError, WatchConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# variable -> (text, the option it sets, the value the option gets)
GOOD = {
    "TENSORWATCH_MAX_FRAMES": ("5", "max_frames", 5),
    "TENSORWATCH_EVERY_N_BATCHES": ("3", "every_n_batches", 3),
    "TENSORWATCH_ON_DETECT": ("Report", "on_detect", "report"),
    "TENSORWATCH_GRADIENTS": ("yes", "gradients", True),
    "TENSORWATCH_INCLUDE": ("encoder.*, lm_head", "include", ("encoder.*", "lm_head")),
    "TENSORWATCH_EXCLUDE": ("dropout", "exclude", ("dropout",)),
    "TENSORWATCH_TRACE_BATCHES": ("149,150", "trace_batches", frozenset({149, 150})),
    "TENSORWATCH_ABORT_AFTER_BATCH": ("0", "abort_after_batch", 0),
    "TENSORWATCH_CHECK": ("module", "check", "module"),
    "TENSORWATCH_OPTIMIZER_STATE": ("1", "optimizer_state", True),
    "TENSORWATCH_CAPTURE_DIR": ("/tmp/tw-captures", "capture_dir", "/tmp/tw-captures"),
    "TENSORWATCH_MAX_SKIPPED_STEPS": ("7", "max_skipped_steps", 7),
    "TENSORWATCH_RERUN_ON_DETECT": ("on", "rerun_on_detect", True),
    "TENSORWATCH_FLUSH_TIMEOUT_SECONDS": ("0.5", "flush_timeout_s", 0.5),
    "TENSORWATCH_MAX_OVERHEAD": ("0.02", "max_overhead", 0.02),
}

# variable -> (bad text, a piece of the message that gives the valid range)
BAD = {
    "TENSORWATCH_MAX_FRAMES": ("0", "integer from 1 to 100000"),
    "TENSORWATCH_EVERY_N_BATCHES": ("every", "integer >= 1"),
    "TENSORWATCH_ON_DETECT": ("ignore", "raise, report"),
    "TENSORWATCH_GRADIENTS": ("maybe", "1, true, yes, on"),
    "TENSORWATCH_TRACE_BATCHES": ("3,-1", "integers >= 0"),
    "TENSORWATCH_ABORT_AFTER_BATCH": ("-2", "integer >= 0"),
    "TENSORWATCH_CHECK": ("step", "batch, module"),
    "TENSORWATCH_OPTIMIZER_STATE": ("2", "0, false, no, off"),
    "TENSORWATCH_MAX_SKIPPED_STEPS": ("1.5", "integer >= 1"),
    "TENSORWATCH_RERUN_ON_DETECT": ("sometimes", "1, true, yes, on"),
    "TENSORWATCH_FLUSH_TIMEOUT_SECONDS": ("soon", "number >= 0"),
    "TENSORWATCH_MAX_OVERHEAD": ("2%", "between 0 and 1"),
}


@pytest.fixture
def clean_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith(("OTEL_", "TENSORWATCH_")):
            monkeypatch.delenv(k)
    return monkeypatch


def test_nothing_set_gives_the_documented_defaults(clean_env):
    cfg = WatchConfig.build()
    assert cfg == WatchConfig.build(environ={}) == WatchConfig()
    assert (cfg.max_frames, cfg.every_n_batches, cfg.on_detect, cfg.gradients, cfg.check,
            cfg.flush_timeout_s, cfg.max_skipped_steps) == (21, 1, "raise", False, "batch", 5.0, 20)
    assert DEFAULTS["max_frames"] == 21 and DEFAULTS["on_detect"] == "raise"


@pytest.mark.parametrize("var", sorted(GOOD))
def test_each_variable_sets_its_option_when_the_watcher_is_built(clean_env, var):
    raw, option, want = GOOD[var]
    # set after the package was imported: the environment is read when a watcher is built
    clean_env.setenv(var, raw)
    # module paths the include/exclude examples match (an include matching nothing is an error)
    model = torch.nn.ModuleDict({"encoder": torch.nn.Sequential(torch.nn.Linear(2, 2)),
                                 "lm_head": torch.nn.Linear(2, 2), "dropout": torch.nn.Dropout()})
    w = watch(model, sinks=[])
    try:
        assert getattr(w.config, option) == want
        others = {k: v for k, v in DEFAULTS.items() if k != option}
        assert {k: getattr(w.config, k) for k in others} == others
    finally:
        w.detach()


# option -> (an argument that differs from GOOD's value, what the option then is)
ARGS = {
    "max_frames": (9, 9), "every_n_batches": (2, 2), "on_detect": ("raise", "raise"),
    "gradients": (False, False), "include": ("x.*", ("x.*",)), "exclude": ([], ()),
    "trace_batches": ((), frozenset()), "abort_after_batch": (4, 4), "check": ("batch", "batch"),
    "optimizer_state": (False, False), "capture_dir": ("/tmp/tw-other", "/tmp/tw-other"),
    "max_skipped_steps": (3, 3), "rerun_on_detect": (False, False), "flush_timeout_s": (2, 2.0),
    "max_overhead": (0.1, 0.1),
}


@pytest.mark.parametrize("var", sorted(GOOD))
def test_argument_beats_variable(clean_env, var):
    raw, option, from_env = GOOD[var]
    arg, want = ARGS[option]
    assert want != from_env
    clean_env.setenv(var, raw)
    assert getattr(WatchConfig.build(**{option: arg}), option) == want


@pytest.mark.parametrize("var", sorted(BAD))
def test_bad_value_names_the_variable_and_the_range(clean_env, var):
    raw, rng = BAD[var]
    clean_env.setenv(var, raw)
    with pytest.raises(ConfigError) as info:
        watch(torch.nn.Linear(2, 2), sinks=[])
    msg = str(info.value)
    assert msg.startswith(f"{var}="), msg
    assert repr(raw) in msg and rng in msg, msg
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("raw", ["inf", "nan", "1e999"])
def test_flush_timeout_must_be_finite(clean_env, raw):
    """A flush cannot wait forever: an infinite timeout would fail in the exporters' flush on a
    detection, the moment nothing may be lost."""
    clean_env.setenv("TENSORWATCH_FLUSH_TIMEOUT_SECONDS", raw)
    with pytest.raises(ConfigError, match=r"TENSORWATCH_FLUSH_TIMEOUT_SECONDS=.*finite number >= 0"):
        watch(torch.nn.Linear(2, 2), sinks=[])


def test_blank_variable_is_unset(clean_env):
    clean_env.setenv("TENSORWATCH_MAX_FRAMES", "  ")
    assert WatchConfig.build().max_frames == 21


def test_on_detect_report_from_env_changes_behaviour(clean_env):
    torch.manual_seed(0)
    model, x, c = OverflowNet(), torch.randn(2, 8), Collect()
    clean_env.setenv("TENSORWATCH_ON_DETECT", "report")
    clean_env.setenv("TENSORWATCH_MAX_FRAMES", "2")
    with watch(model, sinks=[c]):
        model(x)
        model.boom.factor = 1e39
        model(x)  # reported, not raised
        model(x)
    [first, *_] = c.of(NonFiniteEvent)
    assert len(first.frames) == 2 and first.frames[-1].module == "boom"
    # the argument wins over the variable
    model.boom.factor = 1.0
    with watch(model, sinks=[c], on_detect="raise"):
        model(x)
        model.boom.factor = 1e39
        with pytest.raises(NonFiniteDetected):
            model(x)


def test_every_n_batches_from_env_skips_batches(clean_env):
    model, x, c = torch.nn.Linear(4, 4), torch.randn(2, 4), Collect()
    clean_env.setenv("TENSORWATCH_EVERY_N_BATCHES", "3")
    with watch(model, sinks=[c]) as w:
        for _ in range(6):
            model(x)
    assert w.batch_number == 6
    assert [b.batch_number for b in c.batches] == [0, 3]


def test_dropin_keeps_the_peers_defaults_whatever_the_environment(clean_env):
    clean_env.setenv("TENSORWATCH_MAX_FRAMES", "3")
    clean_env.setenv("TENSORWATCH_ON_DETECT", "report")
    clean_env.setenv("TENSORWATCH_GRADIENTS", "1")
    clean_env.setenv("TENSORWATCH_EXCLUDE", "boom")
    clean_env.setenv("TENSORWATCH_EVERY_N_BATCHES", "5")
    clean_env.setenv("TENSORWATCH_TRACE_BATCHES", "0")
    model = OverflowNet()
    debug = DebugUnderflowOverflow(model)
    try:
        cfg = debug._watcher.config
        assert cfg == WatchConfig(max_frames=21, on_detect="raise", guard_steps=False)  # the peer checks forwards only
    finally:
        debug.detach()


def _package_files():
    pkg = os.path.join(ROOT, "tensorwatch_otel")
    for folder, _, files in os.walk(pkg):
        for f in files:
            if f.endswith(".py"):
                yield os.path.join(folder, f)


def test_every_variable_is_one_constant_in_core_env():
    literal = re.compile(r"""["'](TENSORWATCH_[A-Z0-9_]+)["']""")
    where = {}
    for path in _package_files():
        with open(path, encoding="utf-8") as fh:
            for name in literal.findall(fh.read()):
                where.setdefault(name, set()).add(os.path.relpath(path, ROOT))
    assert set(where) == set(twenv.ALL)
    assert all(files == {os.path.join("tensorwatch_otel", "core", "env.py")} for files in where.values()), where
    constants = {v for k, v in vars(twenv).items() if k.startswith("ENV_")}
    assert constants == set(twenv.ALL) and len(twenv.ALL) == len(set(twenv.ALL))


@pytest.mark.parametrize("doc", [os.path.join("docs", "reference", "options.md")])
def test_every_variable_is_documented(doc):
    with open(os.path.join(ROOT, doc), encoding="utf-8") as fh:
        text = fh.read()
    missing = [v for v in twenv.ALL if f"`{v}" not in text]
    assert not missing, f"{doc} does not list {missing}"
