"""rollstream: a streaming rollout pipeline on Kafka for LLM reinforcement learning."""
