"""The producers tier, installed as rollstream.producers (the package mapping in pyproject.toml)."""
