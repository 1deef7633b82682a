"""A get: the pages a lookup found, fetched from their replicas and verified (``fetch``),
landing in the caller's memory as ``landing`` chooses (``reads``), or in device memory
straight from a same-host node (``device_pages``)."""
