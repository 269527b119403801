"""`python -m rollstream.consumers` runs this tier like `rollstream <tier>`."""

import sys

from rollstream.cli import main

TIER = {"producers": "producer", "rollout_workers": "rollout-worker", "reward_workers": "reward-worker", "consumers": "grouping"}["consumers"]

if __name__ == "__main__":
    sys.exit(main([TIER, *sys.argv[1:]]))
