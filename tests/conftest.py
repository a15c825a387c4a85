"""Tests run two pytest-xdist workers on two cores: one Paddle thread each avoids oversubscription."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

from erniekit.utils.malloc import keep_freed_memory  # noqa: E402  (as `erniekit` does: freed tensors are reused)

keep_freed_memory()
