"""The data-plane wire: frames (protocol), UCX channels (transport), the same-host path (shm)."""
