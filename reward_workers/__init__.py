"""The reward_workers tier, installed as rollstream.reward_workers (see rollstream/_names.py)."""

from rollstream._names import adopt

adopt(__name__)  # imported by its pre-0.2 top-level name: warn and become rollstream.reward_workers
