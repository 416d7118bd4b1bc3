"""Training: the task losses (`losses`); the trainer builds on them."""

from .losses import task_loss

__all__ = ["task_loss"]
