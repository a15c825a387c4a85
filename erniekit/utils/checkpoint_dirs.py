"""Which `checkpoint-N/` directories an output_dir holds. Light (no paddle): the config checks
ask it before a run starts, the trainer when it resumes and rotates."""

from __future__ import annotations

import os
import re

STATE_NAME = "trainer_state.json"  # written last into a checkpoint: its presence marks a complete one
_CKPT_RE = re.compile(r"^checkpoint-(\d+)$")


def list_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint in output_dir, oldest first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        m = _CKPT_RE.match(name)
        if m and os.path.isfile(os.path.join(output_dir, name, STATE_NAME)):
            found.append((int(m[1]), os.path.join(output_dir, name)))
    return sorted(found)
