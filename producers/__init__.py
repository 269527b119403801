"""The producers tier, installed as rollstream.producers (see rollstream/_names.py)."""

from rollstream._names import adopt

adopt(__name__)  # imported by its pre-0.2 top-level name: warn and become rollstream.producers
