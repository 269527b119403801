"""Trajectory math, written once for every tier: what a row is, how rows are padded together,
and which policy versions wrote them.

- :mod:`rollstream.trajectory.rows`: the keys and dtypes of a trajectory dict, building a row
  from prompt and output segments (``TrajectoryBuilder``, ``trajectory_row``) and
  ``validate_trajectory`` (torch).
- :mod:`rollstream.trajectory.padding`: the one padding (``concat_padded_arrays`` in numpy,
  ``concat_padded_tensors`` as torch views of it) and ``align_keys`` for dicts whose keys differ.
- :mod:`rollstream.trajectory.staleness`: a row's span (``row_spans``), the head and tail
  version of rows, episodes or groups (``head_and_tail``) and ``staleness``.

``padding`` and ``versions`` never import torch at module level: the grouping, producer, dump
and reward tiers use them without torch. Nothing is imported here, so importing one module
imports only what it needs.
"""
