"""In-memory snapshots, their buddy replicas and where each replica lives."""
