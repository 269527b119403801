"""Rewards: the built-in reward functions (:mod:`~rollstream.rewards.functions`, importable from
here as ``reward.reward_fn: rollstream.rewards:exact_match_reward``), ``AsyncRewardWrapper``
(:mod:`~rollstream.rewards.wrapper`) and the process pool that runs reward functions
(:mod:`~rollstream.rewards.pool`, :mod:`~rollstream.rewards.pool_worker`).

Importing this package imports only the reward functions (and they nothing heavy): pool worker
processes import it to unpickle a built-in function, and they must start fast.
"""

from rollstream.rewards.functions import exact_match_reward, math_verify_reward

__all__ = ["exact_match_reward", "math_verify_reward"]
