"""Planning: disk, extraction, training and serving-speedup estimates for a model on a machine."""
