"""``hieragent fit|validate|test|predict --config configs/<x>.yaml``: the LightningCLI entry point.

The config schema is the signatures of ``HierAgentModule`` and ``RolloutDataModule``;
LightningCLI gives ``--help``, ``--print_config`` and dotted overrides such as
``--trainer.max_steps 3``. ``hieragent envs`` lists the environment names;
``hieragent bank list|search|export --ckpt_path <ckpt>`` inspects a checkpoint's skill bank;
``hieragent export`` writes a trained agent as PEFT adapters, bank and model card, and
``hieragent play`` shows one episode of it (``agent_command.py``).

A run prints its own progress and tables; ``--verbose`` (or ``HIERAGENT_DEBUG=1``) also shows
the third-party notices that are hidden otherwise (``quiet_third_party``).

Errors that come from bad input (a config value, a model path, an env name, a checkpoint)
are printed as one line, with a non-zero exit; ``HIERAGENT_DEBUG=1`` shows the traceback.
"""

from __future__ import annotations

import os
import sys
import warnings
import zipfile
from pathlib import Path
from typing import Any

from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.utilities import rank_zero_only

from hieragent.models.loading import set_offline
from hieragent.precision import machine_precision
from hieragent.strategies import RolloutDDPStrategy, check_strategy, process_count


class HierAgentCLI(LightningCLI):
    def _parse_ckpt_path(self) -> None:
        """Resuming keeps the model settings given now (config file and flags).

        Lightning 2.6 replaces them with the checkpoint's hyper-parameters, which silently
        drops a flag such as ``--model.memory.index.kind flat`` on resume. Here what was given
        wins, and every model setting that differs from the checkpoint's is named on stderr.
        """
        sub = self.config.get("subcommand")
        if not sub:
            return
        ckpt = self.config[sub].get("ckpt_path")
        if ckpt and ckpt not in ("last", "best", "hpc", "registry"):
            check_checkpoint(ckpt)  # a one-line error before Lightning's own torch.load
        given = self.config[sub].get("model")
        if given is None:
            return super()._parse_ckpt_path()
        given = given.clone()
        super()._parse_ckpt_path()
        saved = self.config[sub]["model"]
        for key, (now, then) in sorted(setting_differences(given, saved).items()):
            sys.stderr.write(f"resuming with model.{key}={now!r}; the checkpoint was trained with {then!r}\n")
        self.config[sub]["model"] = given

    def before_instantiate_classes(self) -> None:
        """A strategy that cannot run here fails in one line (``strategies.check_strategy``), and
        ``ddp`` (or several devices) runs as ``strategies.RolloutDDPStrategy``;
        a ``trainer.precision`` left unset (None) becomes the one that fits the machine.

        bf16 is fast on some of our machines and hundreds of times slower on others, so no
        fixed default suits all. The choice lands in the config, and so in the run's saved
        ``config.yaml``. ``--print_config`` still shows null: it prints during parsing.
        """
        config = self.config[self.subcommand] if self.subcommand else self.config
        trainer = config.get("trainer")
        if trainer is None:
            return
        devices, nodes = trainer.get("devices", "auto"), trainer.get("num_nodes", 1)
        self._rollout_ddp = check_strategy(trainer.get("strategy"), devices, nodes)
        data = config.get("data")
        if data is not None and data.get("eval_episodes") is not None:
            from hieragent.lightning.datamodule import check_processes

            check_processes(data.get("eval_episodes"), data.get("demos"), process_count(devices, nodes))
        if trainer.get("precision") is not None:
            return
        precision, reason = machine_precision(trainer.get("accelerator", "auto"))
        trainer.precision = precision
        if rank_zero_only.rank == 0:  # DDP ranks each run this CLI; one line is enough
            sys.stderr.write(f"hieragent: precision {precision} ({reason}); "
                             "set trainer.precision to override\n")

    def instantiate_trainer(self, **kwargs: Any):
        """The config's trainer, with atomic checkpoint writes and a frozen heap
        (``callbacks.FrozenHeap``) unless the config gives its own."""
        from hieragent.lightning.callbacks import AtomicCheckpointIO, FrozenHeap

        config = self._get(self.config_init, "trainer", default={})
        plugins, callbacks = listed(config.get("plugins")), listed(config.get("callbacks"))
        if not any(isinstance(p, CheckpointIO) for p in plugins):
            plugins = [*plugins, AtomicCheckpointIO()]
        if not any(isinstance(c, FrozenHeap) for c in callbacks):
            kwargs["callbacks"] = [*callbacks, FrozenHeap()]
        if getattr(self, "_rollout_ddp", False) and isinstance(config.get("strategy") or "auto", str):
            kwargs["strategy"] = RolloutDDPStrategy()  # `ddp`, or `auto` on several devices
        trainer = super().instantiate_trainer(plugins=plugins, **kwargs)
        align_logger_versions(trainer.loggers)
        return trainer


def listed(value: Any) -> list:
    """A trainer setting given as nothing, one item or a list, as a list."""
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


def align_logger_versions(loggers: list) -> None:
    """Loggers that share a directory write into one run folder, the first logger's.

    Each logger otherwise picks the next free ``version_N`` on its own, and a TensorBoard
    plus CSV pair ends up split over two folders, with the checkpoints in only one.
    """
    if len(loggers) < 2:
        return
    first = loggers[0]
    for other in loggers[1:]:
        if hasattr(other, "_version") and other.root_dir == first.root_dir:
            other._version = first.version  # both loggers keep the version in _version


def setting_differences(given: Any, saved: Any) -> dict[str, tuple[Any, Any]]:
    """Dotted keys whose values differ between two parsed configs: ``{key: (given, saved)}``."""
    def flat(ns: Any, prefix: str = "") -> dict[str, Any]:
        items = ns.as_dict() if hasattr(ns, "as_dict") else ns
        out: dict[str, Any] = {}
        for k, v in (items.items() if isinstance(items, dict) else []):
            if isinstance(v, dict):
                out.update(flat(v, f"{prefix}{k}."))
            else:
                out[f"{prefix}{k}"] = v
        return out

    a, b = flat(given), flat(saved)
    return {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)}


def check_checkpoint(path: str) -> None:
    """A checkpoint path must be a readable torch checkpoint before any work starts."""
    from hieragent.lightning.export import is_export

    p = Path(path)
    if is_export(p):
        raise ValueError(f"ckpt_path '{path}' is an exported agent, not a checkpoint: start from it "
                         f"with --model.init_from {path}")
    if not p.is_file():
        raise FileNotFoundError(f"ckpt_path '{path}' does not exist; expected a .ckpt file "
                                "written by `hieragent fit` (see lightning_logs/*/checkpoints)")
    if not zipfile.is_zipfile(p):
        raise ValueError(f"ckpt_path '{path}' is not a torch checkpoint (not a zip archive); "
                         "it may be truncated or another kind of file")


def _list_envs() -> None:
    from hieragent.envs.base import known_envs

    print("\n".join(known_envs()))


# Lightning notices that are expected here and would bury the run's own output.
_EXPECTED_WARNINGS = (
    # training_step pulls its batch from the iterator, once per step, on purpose: rollouts
    # must use the weights of the current step, which Lightning's prefetching would not give
    r".*`dataloader_iter`",
    # the rollout dataset has a length for the progress bar, and is never split over workers
    r"Your `IterableDataset` has `__len__` defined",
    # raised inside Lightning's own pytree helper under recent torch
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    # checkpoints are meant to hold the weights after the step's update
    r"Using ModelCheckpoint with manual optimization",
    # the module moves rollout batches itself (they are episodes, not tensors)
    r"You have overridden `transfer_batch_to_device`",
)


def quiet_expected_warnings() -> None:
    for pattern in _EXPECTED_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)


def _commands() -> dict[str, Any]:
    """The subcommands that are not LightningCLI's, by name."""
    from hieragent.agent_command import export_main, play_main
    from hieragent.bank_command import main as bank_main

    return {"bank": bank_main, "export": export_main, "play": play_main}


def verbose(argv: list[str]) -> bool:
    return "--verbose" in argv or any(os.environ.get(v) for v in ("HIERAGENT_DEBUG", "HIERAGENT_VERBOSE"))


def quiet_third_party() -> None:
    """A run prints its own progress and tables: Lightning's info lines (accelerators, seed,
    advertising tips, why fit stopped), transformers' loading bars and its deprecation
    notices are hidden. ``--verbose`` or ``HIERAGENT_DEBUG=1`` keeps them."""
    import logging

    from transformers.utils import logging as hf_logging

    for name in ("lightning.pytorch", "lightning.fabric", "lightning_fabric", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.WARNING)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    for package in ("transformers", "peft"):
        for category in (FutureWarning, DeprecationWarning):
            warnings.filterwarnings("ignore", category=category, module=package)


def _fail(err: Exception) -> None:
    if os.environ.get("HIERAGENT_DEBUG"):
        raise err
    print(f"hieragent: error: {err}", file=sys.stderr)
    sys.exit(2)


def main(args: list[str] | None = None) -> None:
    set_offline()
    quiet_expected_warnings()
    argv = sys.argv[1:] if args is None else list(args)
    if not verbose(argv):
        quiet_third_party()
    if "--verbose" in argv:  # not a LightningCLI option; DDP ranks re-run the command line
        argv.remove("--verbose")
        args, sys.argv = argv, [sys.argv[0], *argv]
        os.environ["HIERAGENT_VERBOSE"] = "1"
    if argv[:1] == ["envs"]:
        _list_envs()
        return
    commands = _commands()
    if argv[:1] and argv[0] in commands:
        try:
            commands[argv[0]](argv[1:])
        except (ValueError, FileNotFoundError, FileExistsError, KeyError) as err:
            _fail(err)
        return
    from hieragent.lightning.datamodule import RolloutDataModule
    from hieragent.lightning.module import HierAgentModule

    try:
        HierAgentCLI(
            HierAgentModule,
            RolloutDataModule,
            args=args,
            save_config_kwargs={"overwrite": True},
            seed_everything_default=0,
        )
    except (ValueError, FileNotFoundError, KeyError) as err:
        _fail(err)


if __name__ == "__main__":
    main()
