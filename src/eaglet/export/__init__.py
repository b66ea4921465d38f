"""The export stage: a trained run's head written in a serving format (the formats: `eaglet.formats`)."""
