"""How the ranks of a trainer job (``torchrun``) work together on each step.

- :mod:`~rollstream.trainer.ranks.world`: this process's rank among the job's ranks, and the
  gloo process group whose collectives share the steps (:class:`Ranks`);
- :mod:`~rollstream.trainer.ranks.split`: which groups of a step each rank trains (whole
  groups, balanced by tokens, deterministic);
- :mod:`~rollstream.trainer.ranks.share`: what rank 0 sends each rank per round (its share of a
  step, or ``idle`` / ``stop``), as MessagePack;
- :mod:`~rollstream.trainer.ranks.heartbeats`: heartbeats between the ranks, so a dead, stalled
  or failed rank is named within seconds;
- :mod:`~rollstream.trainer.ranks.health`: what a rank does about the others' health (its step
  and phase, where the job resumes, the one line and exit when a rank is lost);
- :mod:`~rollstream.trainer.ranks.restarts`: where this process stands among ``torchrun``'s
  restarts of its job.
"""

from rollstream.trainer.ranks.world import Ranks

__all__ = ["Ranks"]
