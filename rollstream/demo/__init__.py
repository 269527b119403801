"""``rollstream demo``: the whole pipeline on one machine with a tiny model and a GRPO trainer.

The core never imports a tier: the tiers run as subprocesses (``python -m rollstream.cli
<tier>``) and the example trainer (``examples/grpo_trainer.py``) is loaded only when the demo
runs. Modules: ``task`` (prompts, reward), ``model`` (tiny model + format warm-up),
``settings`` (the demo's knobs and its config file), ``children`` (tier subprocesses),
``progress`` (live view, lag), ``report`` (summary, plot), ``example_trainer`` (finds
``examples/grpo_trainer.py``), ``runner`` (the orchestration),
``commands`` (the CLI).
"""
