"""The disk tier below a node's memory (docs/storage-tiers.md); ``tier.py`` wires its parts."""
