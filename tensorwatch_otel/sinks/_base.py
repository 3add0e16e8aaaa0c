"""The sink port, as the sinks see it: defined in the core (core/ports.py), which never
imports a sink."""

from __future__ import annotations

from ..core.ports import Sink, SinkFanout

__all__ = ["Sink", "SinkFanout"]
