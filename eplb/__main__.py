"""`python -m eplb`: the `eplb` command line (eplb.cli)."""
import sys

from eplb.cli import main

if __name__ == "__main__":
    sys.exit(main())
