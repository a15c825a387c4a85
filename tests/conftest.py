"""Tests run two pytest-xdist workers on two cores: one Paddle thread each avoids oversubscription."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
