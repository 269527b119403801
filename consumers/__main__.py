"""`python -m rollstream.consumers` runs this tier like `rollstream <tier>`."""

import sys

from rollstream._names import warn_if_run_by_old_name
from rollstream.cli import main

TIER = {"producers": "producer", "rollout_workers": "rollout-worker", "reward_workers": "reward-worker", "consumers": "grouping"}["consumers"]

if __name__ == "__main__":
    warn_if_run_by_old_name(__spec__)  # `python -m consumers`, before 0.2
    sys.exit(main([TIER, *sys.argv[1:]]))
