"""The rollout_workers tier, installed as rollstream.rollout_workers (the package mapping in pyproject.toml)."""
