"""Shared state in Redis: the client and keys (``client``), the epoch that tells a Redis that
came back older (``epoch``), the trainer's weight versions (``versions``), the staleness budget
(``budget``, its scripts in ``budget_scripts``) and the SGLang servers' weight-sync leases
(``server_lease``)."""
