"""The reward_workers tier, installed as rollstream.reward_workers (the package mapping in pyproject.toml)."""
