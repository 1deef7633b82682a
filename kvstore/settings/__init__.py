"""Options of nodes and clients (pydantic-settings) and byte sizes."""
