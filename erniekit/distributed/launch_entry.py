"""Script that paddle.distributed.launch runs in each worker: `erniekit <args>`.

The launcher takes a script path, not a module; this folder must not shadow top-level
modules, so it is dropped from sys.path before anything is imported.
"""

import sys

if __name__ == "__main__":
    sys.path.pop(0)
    from erniekit.cli import main

    sys.exit(main(sys.argv[1:]))
