"""The contracts between user code and rollstream, AReaL's names kept: workflows and what an
episode returns (``workflow``), engines and the error they refuse a request with (``engine``),
requests and responses (``io_struct``) and the episode's context (``context``). Nothing here
imports another part of rollstream; what implements them lives with the layer that uses it
(the request checks in ``rollstream.engines.request_check``, the workflows' statistics in
``rollstream.runtime.stats``)."""
