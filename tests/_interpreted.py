"""Triton's interpreter for the device path's tests (the CUDA kernel run on CPU tensors). Import
this module before anything imports Triton: Triton reads TRITON_INTERPRET once, when it is first
imported, for the whole process. On a machine without CUDA it sets TRITON_INTERPRET=1 (nothing
else in the suite uses Triton there); on a GPU machine it leaves Triton alone, since the
interpreter would take the real Triton from every other test in the session: run these tests
there in a pytest process of their own with TRITON_INTERPRET=1."""

from __future__ import annotations

import os
import sys

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpreted() -> bool:
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        return False
    language = sys.modules.get("triton.language")
    # imported earlier: its own jit functions tell which mode Triton was imported in
    return language is None or type(language.zeros).__name__ == "InterpretedFunction"


INTERPRETED = _interpreted()
REASON = ("Triton's interpreter is not on for this process: set TRITON_INTERPRET=1 for the whole pytest run "
          "(on a GPU machine, in a run of its own), before Triton is first imported")
