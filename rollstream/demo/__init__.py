"""``rollstream demo``: the whole pipeline on one machine with a tiny model and a GRPO trainer.

The core never imports a tier: the tiers run as subprocesses (``python -m rollstream.cli
<tier>``), and so does the example trainer (``examples/grpo_trainer.py``, under ``torchrun``
with ``--trainer-ranks`` > 1). Modules: ``task`` (prompts, reward), ``model`` (tiny model + format warm-up),
``settings`` (the demo's knobs and its config file), ``children`` (tier subprocesses),
``progress`` (live view, lag), ``report`` (summary, plot), ``example_trainer`` (finds and
launches ``examples/grpo_trainer.py``), ``runner`` (the orchestration),
``commands`` (the CLI).
"""
