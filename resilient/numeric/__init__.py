"""Numerical faults: non-finite losses and gradients, loss spikes, and the response."""
