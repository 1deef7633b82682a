"""Helpers that more than one bench script uses (bench/transfer.py, bench/events.py,
bench/tier.py), each in one place."""
