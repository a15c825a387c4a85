"""The one training core: loop, optimizer, schedules, checkpoints and logging; stages plug in."""
