"""The sections of bench/gpu_check.py and what they share (the entry point and its
argument parsing stay in bench/gpu_check.py). Imports nothing: the modules that use torch
are imported only once the carried wheels are on the path."""
