"""Sweeps over training settings (conf/sweeps/*.yaml): per-trial measurement at every serving draft length, and
the summary that recommends a setting for a target and hardware (python -m eaglet.sweeps.summarize)."""
