"""`python -m rollstream.consumers` runs this tier like `rollstream grouping`."""

import sys

from rollstream.cli import main

if __name__ == "__main__":
    sys.exit(main(["grouping", *sys.argv[1:]]))
