"""`python -m erniekit ...` runs the CLI."""

import sys

from erniekit.cli import main

if __name__ == "__main__":
    sys.exit(main())
