"""Training that survives: sharded, atomic checkpoints (`Checkpoint`), an exact
resume, restores onto any mesh, process count or backend (`restore`), and one
plain Keras file for serving (`export`)."""

from keras_dist.checkpoint.api import export, restore
from keras_dist.checkpoint.callback import Checkpoint
from keras_dist.checkpoint.damaged import DamagedCheckpointError
from keras_dist.checkpoint.preemption import PREEMPTED_EXIT_CODE

__all__ = [
    "PREEMPTED_EXIT_CODE",
    "Checkpoint",
    "DamagedCheckpointError",
    "export",
    "restore",
]
