"""Sharded, verified, exact-resume checkpoints on torch.distributed.checkpoint."""

from resilient.checkpoint.manager import CheckpointConfig, CheckpointInfo, CheckpointManager
from resilient.checkpoint.state import TrainState, state_digest
from resilient.checkpoint.tiers import TieredCheckpointManager, open_manager

__all__ = [
    "CheckpointConfig",
    "CheckpointInfo",
    "CheckpointManager",
    "TieredCheckpointManager",
    "TrainState",
    "open_manager",
    "state_digest",
]
