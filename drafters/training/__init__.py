"""The shared trainer of learned draft heads: ``train(TrainConfig(...))`` runs what ``jetflow train`` does."""

from jetflow.drafters.training.config import TrainConfig
from jetflow.drafters.training.result import TrainResult
from jetflow.drafters.training.run import train

__all__ = ["TrainConfig", "TrainResult", "train"]
