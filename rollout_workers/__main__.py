"""`python -m rollstream.rollout_workers` runs this tier like `rollstream rollout-worker`."""

import sys

from rollstream.cli import main

if __name__ == "__main__":
    sys.exit(main(["rollout-worker", *sys.argv[1:]]))
