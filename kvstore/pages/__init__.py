"""Pages and their names: namespaces, block hashes (the C chain), head groups, index key names, checksums."""
