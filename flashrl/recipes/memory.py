"""Moved below the algorithms, to ``flashrl.plan.memory`` (the run plan's); this path still imports."""

from flashrl.plan.memory import *
from flashrl.plan.memory import EXPORT_BUCKET_BYTES, GIB  # noqa: F401
