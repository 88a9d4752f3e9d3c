"""A simulated engine for scale tests: the real scheduler, block pool and prefix cache; no model."""
