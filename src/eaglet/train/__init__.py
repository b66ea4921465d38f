"""Training of the draft head: the KD teacher and loss, and the training-time-test unroll."""
