"""Sharded, verified, exact-resume checkpoints on torch.distributed.checkpoint."""

from resilient.checkpoint.manager import CheckpointConfig, CheckpointInfo, CheckpointManager
from resilient.checkpoint.state import TrainState, state_digest

__all__ = ["CheckpointConfig", "CheckpointInfo", "CheckpointManager", "TrainState", "state_digest"]
