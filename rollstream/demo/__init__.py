"""``rollstream demo``: the whole pipeline on one machine with a tiny model and a GRPO trainer.

The core never imports a tier: the tiers run as subprocesses (``python -m rollstream.cli
<tier>``), and so does the example trainer (``examples/grpo_trainer.py``, under ``torchrun``
with ``--trainer-ranks`` > 1); ``runner`` orchestrates a run.
"""
