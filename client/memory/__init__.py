"""Memory pages move through: byte spans (``buffers``), the process's pool of reused,
faulted-in host arenas (``staging``), and device memory reached straight from a
same-host node's pages (``device_pages``: the seam connections land pages through)."""
