"""A lookup: how much of a prompt is stored and where (``prefix``: one index round trip
per prompt), what it found, for a get to fetch (``stored_prefix``), and the client's
namespace in the index that lookups read (``registration``)."""
