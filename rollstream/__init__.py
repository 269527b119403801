"""rollstream: a streaming rollout pipeline on Kafka for LLM reinforcement learning."""

from rollstream._names import install as _install_names

_install_names()  # rollstream.<tier> from a checkout; the old top-level tier names (one release)
