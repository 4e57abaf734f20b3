"""Exactness: per-step fingerprints, comparing two runs' steps, and `resilient check-resume`."""
