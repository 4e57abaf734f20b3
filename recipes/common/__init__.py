"""Shared building blocks for the example training recipes (model, data)."""
