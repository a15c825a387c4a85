"""Script that paddle.distributed.launch runs in each worker: `erniekit <args>`; and, as
`launch_entry.py --launcher ARGS`, the launcher itself (`python -m paddle.distributed.launch ARGS`).

Both ask the kernel for SIGTERM when their parent dies (Linux PR_SET_PDEATHSIG): a launcher whose
`erniekit train` was SIGKILLed stops its ranks, and a rank whose launcher was SIGKILLed stops
after its step with a checkpoint, instead of training on orphaned.

The launcher takes a script path, not a module; this folder must not shadow top-level
modules, so it is dropped from sys.path before anything is imported.
"""

import os
import sys


def _die_with_parent() -> None:
    from erniekit.utils.run_control import die_with_parent

    if die_with_parent() and os.getppid() == 1:  # the parent died before prctl: nobody would signal us
        sys.exit("erniekit: the process that started this one is gone; not starting")


if __name__ == "__main__":
    sys.path.pop(0)
    _die_with_parent()
    if sys.argv[1:2] == ["--launcher"]:
        import logging
        import runpy

        from erniekit.cli import drop_paddle_ccache_warning

        drop_paddle_ccache_warning()  # the ranks run main(), which drops it too
        # paddle's rendezvous polls the master over httpx, which logs each request at INFO (two lines
        # every 0.5 s while a node waits for the others)
        logging.getLogger("httpx").setLevel(logging.WARNING)
        sys.argv = ["paddle.distributed.launch", *sys.argv[2:]]
        runpy.run_module("paddle.distributed.launch", run_name="__main__", alter_sys=True)
        sys.exit(0)
    from erniekit.cli import main

    sys.exit(main(sys.argv[1:]))
