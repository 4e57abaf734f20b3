"""Process groups, exits and DDP internals: what every other layer of a worker stands on."""
