"""What every tier process runs with: logging (``logs``), metrics and health endpoints
(``metrics``, ``health``), graceful shutdown on signals (``shutdown``), background tasks (``tasks``)."""
