"""The package version, in a module of its own: checkpoint code records it in every manifest
without importing the top-level package (which would make an import cycle through it)."""

__version__ = "0.1.0"
