"""The parts of bench/transfer.py: its worker processes, its side of them and its tables,
and the sections after the put/get table (the entry point stays in bench/transfer.py)."""
