"""Weights in and out of resilient checkpoints: export, load_model, init_from."""
