"""`python -m flashrl ...` is the `flashrl` command (see flashrl.cli)."""

import sys

from flashrl.cli import main

if __name__ == "__main__":
    sys.exit(main())
