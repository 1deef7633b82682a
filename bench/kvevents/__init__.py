"""The sections of bench/events.py (KV events), one module per section or two (the entry
point and its argument parsing stay in bench/events.py)."""
