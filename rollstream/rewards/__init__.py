"""Rewards: the built-in reward functions, and the process pool that runs reward functions.

- :mod:`rollstream.rewards.functions`: ``exact_match_reward``, ``math_verify_reward``, also
  importable from here (``reward.reward_fn: rollstream.rewards:exact_match_reward``);
- :mod:`rollstream.rewards.wrapper`: ``AsyncRewardWrapper``, the workflow-facing call (timeout,
  retries; a timeout after the last try yields 0.0), whose ``call`` raises ``RewardTimeout``
  instead (what the reward tier's ``reward.on_timeout`` decides about);
- :mod:`rollstream.rewards.pool`: ``RewardPool``, the worker processes, and ``RewardTimeout``;
- :mod:`rollstream.rewards.pool_worker`: what runs in each worker process.

Importing this package imports only the reward functions (and they nothing heavy): pool worker
processes import it to unpickle a built-in function, and they must start fast.
"""

from rollstream.rewards.functions import exact_match_reward, math_verify_reward

__all__ = ["exact_match_reward", "math_verify_reward"]
