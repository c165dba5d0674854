"""The service's vocabulary (its lowest layer, importing no other part of the service): the domain types
and errors every door speaks, the engine Protocol, and the settings of endpointing, redaction and call metrics.

No protocol here (no grpc, aiohttp or generated messages) and no work: the pipeline does that."""
