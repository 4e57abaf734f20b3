"""Preemption: a signal becomes a stop at one step every rank agrees on, inside the grace period."""
