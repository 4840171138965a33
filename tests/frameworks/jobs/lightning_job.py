"""A tiny Lightning run on CPU, with no memtrack code: validation and a
checkpoint. argv: output_dir steps batch_size grad_accum"""
import sys

import lightning.pytorch as pl
import torch

out, steps, batch, accum = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.manual_seed(0)


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def training_step(self, batch, idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def loader(n):
    data = torch.utils.data.TensorDataset(torch.randn(n, 8), torch.randn(n, 1))
    return torch.utils.data.DataLoader(data, batch_size=batch)


trainer = pl.Trainer(
    default_root_dir=out,
    max_steps=steps,
    accumulate_grad_batches=accum,
    val_check_interval=10 * accum,
    check_val_every_n_epoch=None,
    accelerator="cpu",
    devices=1,
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
trainer.fit(Tiny(), loader(512), loader(32))
print("job finished", trainer.global_step)
