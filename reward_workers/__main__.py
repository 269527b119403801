"""`python -m rollstream.reward_workers` runs this tier like `rollstream reward-worker`."""

import sys

from rollstream.cli import main

if __name__ == "__main__":
    sys.exit(main(["reward-worker", *sys.argv[1:]]))
