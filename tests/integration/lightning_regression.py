"""The LightningModule the Lightning tests train: a regression of ``x.sum()`` on ``x`` with
AdamW and a step schedule, so that a checkpoint holds model, optimizer and scheduler state."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch.utils.data import DataLoader, TensorDataset


class Regression(LightningModule):
    """Trains ``self.net`` (set by the subclass) on ``samples`` seeded samples, 4 a batch."""

    net: torch.nn.Module
    samples: int

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)]

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(self.samples, 8, generator=generator)
        return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=4)
