"""Lightning Fabric loggers behind torchrl's logger calls."""

from __future__ import annotations

import torch

__all__ = ["FabricLoggerAdapter"]


class FabricLoggerAdapter:
    """A Lightning Fabric logger (``log_metrics``) behind torchrl's logger calls (``log_scalar``).

    ``Trainer`` wraps a ``lightning.fabric.loggers.Logger`` in it automatically, e.g.
    ``Trainer(..., logger=TensorBoardLogger("runs", name="ppo"))``.

    Examples:
        >>> import os, tempfile, torch
        >>> from lightning.fabric.loggers import CSVLogger
        >>> from fabric_learner.trainer import FabricLoggerAdapter
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     logger = FabricLoggerAdapter(CSVLogger(folder, name="run"))
        ...     logger.log_scalar("loss", torch.tensor(0.5), step=1)  # torchrl's call
        ...     logger.finalize()
        ...     print(open(os.path.join(logger.log_dir, "metrics.csv")).read().strip())
        loss,step
        0.5,1
    """

    def __init__(self, logger) -> None:
        self.logger = logger

    def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
        if isinstance(value, torch.Tensor):
            value = value.item()
        self.logger.log_metrics({name: float(value)}, step=step)

    def log_metrics(self, metrics, step: int | None = None, **kwargs) -> None:
        self.logger.log_metrics({k: float(v.item() if isinstance(v, torch.Tensor) else v) for k, v in metrics.items()},
                                step=step)

    def log_hparams(self, cfg) -> None:
        self.logger.log_hyperparams(cfg)

    def log_histogram(self, name: str, data, **kwargs) -> None:
        return  # Fabric's generic logger API has no histogram call

    def log_video(self, name: str, video, step: int | None = None, **kwargs) -> None:
        return

    def finalize(self, status: str = "success") -> None:
        self.logger.finalize(status)

    def __getattr__(self, name: str):
        return getattr(self.__dict__["logger"], name)

    def __repr__(self) -> str:
        return f"FabricLoggerAdapter({self.logger!r})"


def _adapt_logger(logger):
    if logger is None:
        return None
    try:
        from lightning.fabric.loggers import Logger as FabricLogger
    except ImportError:  # pragma: no cover - lightning is a dependency
        return logger
    return FabricLoggerAdapter(logger) if isinstance(logger, FabricLogger) else logger
