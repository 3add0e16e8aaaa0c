"""`python -m tensorwatch_otel`: the same command line as `tensorwatch-otel`."""

import sys

from .cli import main

sys.exit(main())
