"""The data position: a resumable iterator over a StatefulDataLoader, and its form that
survives a world-size change."""
