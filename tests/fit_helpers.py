"""A real Lightning Trainer for fitting the tiny model in this process: no checkpoints, bars,
summary or sanity validation, every step's metrics in ``tmp_path/run/version_*/metrics.csv``."""

import lightning as L
from lightning.pytorch.loggers import CSVLogger


def quiet_trainer(tmp_path, steps, callbacks=()):
    return L.Trainer(accelerator="cpu", max_steps=steps, logger=CSVLogger(tmp_path, name="run"),
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     num_sanity_val_steps=0, check_val_every_n_epoch=1000, log_every_n_steps=1,
                     callbacks=list(callbacks))
