"""Sharded, verified, exact-resume checkpoints on torch.distributed.checkpoint."""

from resilient.checkpoint.collectives import Collectives
from resilient.checkpoint.config import CheckpointConfig, CheckpointInfo
from resilient.checkpoint.manager import CheckpointManager
from resilient.checkpoint.protocol import CheckpointStore
from resilient.checkpoint.state import TrainState, state_digest
from resilient.checkpoint.tiers import TieredCheckpointManager, open_manager

__all__ = [
    "CheckpointConfig",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointStore",
    "Collectives",
    "TieredCheckpointManager",
    "TrainState",
    "open_manager",
    "state_digest",
]
