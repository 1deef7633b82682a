"""The parts of bench/lookup.py (prefix lookups): its stores, the head and layer groups,
and the paused lookups (the entry point and its main comparison stay in bench/lookup.py)."""
