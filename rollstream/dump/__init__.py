"""Trajectory dumps: one JSON line per sample row (``lines``) in AReaL's file layout (``files``)."""
