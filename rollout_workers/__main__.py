"""`python -m rollstream.rollout_workers` runs this tier like `rollstream <tier>`."""

import sys

from rollstream.cli import main

TIER = {"producers": "producer", "rollout_workers": "rollout-worker", "reward_workers": "reward-worker", "consumers": "grouping"}["rollout_workers"]

if __name__ == "__main__":
    sys.exit(main([TIER, *sys.argv[1:]]))
