"""Moved below the algorithms, to ``flashrl.plan.architectures`` (the run plan's); this path still imports."""

from flashrl.plan.architectures import *
