"""The contracts between user code and rollstream, AReaL's names kept: workflows and what an
episode returns (``workflow``), engines and the error they refuse a request with (``engine``),
requests and responses (``io_struct``), the episode's context (``context``) and its statistics
(``stats``). Nothing here imports another part of rollstream."""
