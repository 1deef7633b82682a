"""A get: the pages a lookup found, fetched from their replicas and verified (``fetch``),
landing in the caller's memory as ``landing`` chooses (``reads``)."""
