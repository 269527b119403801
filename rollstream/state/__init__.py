"""Shared state in Redis: the client and keys (``client``), the trainer's weight versions
(``versions``), the staleness budget (``budget``) and the SGLang servers' weight-sync leases
(``server_lease``)."""
