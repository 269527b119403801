"""The per-episode engine view the worker gives each episode (defined in the core, where
``rollstream.testing`` uses it too)."""

from rollstream.api.recording import EpisodeEngine

__all__ = ["EpisodeEngine"]
