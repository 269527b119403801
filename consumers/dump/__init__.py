"""The dump tier (``rollstream dump``): trajectories as files, one per task."""
