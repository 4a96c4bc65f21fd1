"""`python -m eplb`: the `eplb` command line (eplb.ops.cli)."""
import sys

from eplb.ops.cli import main

if __name__ == "__main__":
    sys.exit(main())
