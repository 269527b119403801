"""`python -m rollstream.producers` runs this tier like `rollstream producer`."""

import sys

from rollstream.cli import main

if __name__ == "__main__":
    sys.exit(main(["producer", *sys.argv[1:]]))
