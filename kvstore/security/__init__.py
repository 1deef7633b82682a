"""Data-plane credentials and the index's ACL rules."""
