"""Examples built on rollstream: the reference GRPO trainer (``grpo_trainer``) and its math (``grpo``)."""
