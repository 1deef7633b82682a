"""A lookup: how much of a prompt is stored and where (``prefix``: one index round trip
per prompt), and the client's namespace in the index that lookups read
(``registration``)."""
