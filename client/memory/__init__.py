"""Host memory pages move through: byte spans (``buffers``) and the process's pool of
reused, faulted-in arenas (``staging``)."""
