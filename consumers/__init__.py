"""The consumers tier, installed as rollstream.consumers (the package mapping in pyproject.toml)."""
