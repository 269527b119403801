"""The contracts between user code and rollstream, AReaL's names kept: workflows and what an
episode returns (``workflow``), engines (``engine``), requests and responses (``io_struct``,
``request_check``), the episode's context (``context``) and its statistics (``stats``).
Nothing here imports another part of rollstream."""
