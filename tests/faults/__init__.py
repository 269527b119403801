"""Fault-injection tests: tiers as separate processes, killed, restarted, starved of Redis/Kafka."""
