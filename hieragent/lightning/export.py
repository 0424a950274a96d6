"""A trained agent as a folder of standard files, and back.

``hieragent export --ckpt_path last.ckpt --out DIR`` writes::

    DIR/planner/      adapter_config.json, adapter_model.safetensors   (PEFT)
    DIR/executor/     the same; both load with PeftModel.from_pretrained(base, DIR/<role>)
    DIR/query_adapter.safetensors   the planner's trained retrieval query map
    DIR/value_head.safetensors      the turn critic (advantage.estimator: gae only)
    DIR/bank/         the skill bank's on-disk folder (memory/store.py)
    DIR/hieragent.json              what to rebuild the agent with: base model, LoRA, modes
    DIR/README.md     a short model card: base model, envs, steps, held-out success

``--model.init_from DIR`` (so ``hieragent fit`` and ``hieragent test``) and
``hieragent play --ckpt_path DIR`` read the folder. The folder is built beside ``DIR`` and
renamed into place, so a failed export leaves no half-written agent.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path
from typing import Any

import torch
from peft import set_peft_model_state_dict
from safetensors.torch import load_file, save

from hieragent.io import scratch_dir, swap_dir, sync_files, write_synced
from hieragent.lightning.state import read_checkpoint

EXPORT_FORMAT = 1
MANIFEST = "hieragent.json"
# module settings that decide how the agent acts; the rest (learning rates, objective) do not
ACTING_SETTINGS = ("model", "model_seed", "lora", "planner_mode", "executor_mode", "temperature",
                   "score_reduction", "rollout", "memory")


def is_export(path: str | Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def module_from(path: str | Path, what: str, **overrides: Any):
    """The ``HierAgentModule`` a checkpoint or an exported folder was trained as, with its
    weights and bank; acts through the ``hf`` engine (``overrides`` win over the saved
    settings)."""
    from hieragent.lightning.module import HierAgentModule

    names = inspect.signature(HierAgentModule.__init__).parameters
    if is_export(path):
        settings = read_manifest(path)["settings"]
    else:
        settings = read_checkpoint(path, what).get("hyper_parameters") or {}
        if "model" not in settings:
            raise ValueError(f"{what}: checkpoint '{path}' has no hieragent hyper-parameters; "
                             "was it written by `hieragent fit`?")
    # LightningCLI saves nested settings as dicts: back into the dataclasses of the defaults
    kwargs = {k: _rebuild(names[k].default, v) for k, v in settings.items() if k in names}
    # the saved weights, without a KL reference copy: acting never reads one
    kwargs.update({"engine": "hf", "init_from": str(path), "kl_reference": "base", **overrides})
    return HierAgentModule(**kwargs)


def export_agent(ckpt_path: str | Path, out: str | Path) -> Path:
    """Write the agent of checkpoint ``ckpt_path`` into folder ``out`` (see the module doc);
    an existing ``out`` is replaced only if it is an earlier export."""
    out = Path(out)
    if out.exists() and not is_export(out) and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"--out '{out}' exists and is not an exported agent; give a new "
                              "folder (an earlier export there would be replaced)")
    checkpoint = read_checkpoint(ckpt_path, "hieragent export")
    module = module_from(ckpt_path, "hieragent export")
    roles = [role for role, _ in module.policies()]
    settings = {k: v for k, v in checkpoint["hyper_parameters"].items() if k in ACTING_SETTINGS}
    data = checkpoint.get("datamodule_hyper_parameters") or {}
    manifest = {
        "format": EXPORT_FORMAT,
        "roles": roles,
        "global_step": int(checkpoint.get("global_step", 0)),
        # what `hieragent play` needs to build the run's envs
        "data": {k: data.get(k) for k in ("env", "test_envs", "max_episode_steps", "invalid_penalty",
                                          "env_options", "workers", "step_timeout", "loop_guard",
                                          "loop_penalty") if k in data},
        "held_out": _held_out(Path(ckpt_path), int(checkpoint.get("global_step", 0))),
        "settings": _plain(settings),
    }
    with scratch_dir(out) as tmp:
        module.lm.save_pretrained(tmp, selected_adapters=roles)  # PEFT: tmp/<role>/ per adapter
        sync_files(tmp)
        for name, part in _parts(module).items():
            if part is not None:
                blob = save({k: v.detach().contiguous() for k, v in part.state_dict().items()})
                write_synced(tmp / f"{name}.safetensors", lambda f, b=blob: f.write(b), binary=True)
        if module.bank is not None:
            module.bank.save(tmp / "bank")
        write_synced(tmp / MANIFEST, lambda f: json.dump(manifest, f, indent=2))
        write_synced(tmp / "README.md", lambda f: f.write(model_card(manifest)))
        swap_dir(tmp, out)
    return out


def _parts(module) -> dict[str, torch.nn.Module | None]:
    """The trained parts beside the adapters: the retrieval query map and the turn critic."""
    return {"query_adapter": getattr(module.planner, "query_adapter", None), "value_head": module.value_head}


def _plain(value: Any) -> Any:
    """Dataclasses as JSON-able dicts (the module's settings)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _rebuild(default: Any, value: Any) -> Any:
    """A setting read back from JSON, as the type of its default (nested dataclasses)."""
    if dataclasses.is_dataclass(default) and isinstance(value, dict):
        names = {f.name for f in dataclasses.fields(default)}
        return dataclasses.replace(default, **{k: _rebuild(getattr(default, k), v)
                                               for k, v in value.items() if k in names})
    return value


def _held_out(ckpt_path: Path, step: int) -> dict[str, Any] | None:
    """The run's held-out evaluation after training, if it ended at this checkpoint's step
    (``eval_summary.json`` of ``BeforeAfterEval``, beside the ``checkpoints`` folder)."""
    summary = ckpt_path.resolve().parent.parent / "eval_summary.json"
    try:
        found = json.loads(summary.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    after = found.get("after") if isinstance(found, dict) else None
    return after if isinstance(after, dict) and found.get("updates") == step else None


def model_card(manifest: dict[str, Any]) -> str:
    s = manifest["settings"]
    held = manifest["held_out"]
    result = ("not recorded with this checkpoint; measure it with "
              "`hieragent test --config <the run's config> --model.init_from <this folder>`")
    if held:
        result = (f"success {held['success']:.3f}, mean return {held['return']:.3f}, mean length "
                  f"{held['length']:.1f} over {int(held['episodes'])} held-out episodes")
    roles = " and ".join(manifest["roles"])
    return "\n".join([
        "# hieragent agent",
        "",
        f"- base model: `{s['model']}`" + (f" (seed {s['model_seed']})" if s["model"] == "tiny" else ""),
        f"- adapters: {roles} (LoRA r={s['lora']['r']}, alpha={s['lora']['alpha']}); "
        f"modes: planner {s['planner_mode']}, executor {s['executor_mode']}",
        f"- trained on: {manifest['data']['env']}, {manifest['global_step']} optimizer steps",
        f"- held-out: {result}",
        "",
        "Load an adapter with PEFT: `PeftModel.from_pretrained(base, '<folder>/executor')`.",
        "Play or evaluate the whole agent (adapters, query adapter, bank) with",
        "`hieragent play --ckpt_path <folder> --env <env> --seed N` or",
        "`hieragent test --config <config> --model.init_from <folder>`.",
        "",
    ])


def saved_data_settings(path: str | Path) -> dict[str, Any]:
    """The data settings of the run behind a checkpoint or an exported folder (env name,
    episode cap, invalid-action penalty, env options); empty if none were saved."""
    if is_export(path):
        return dict(read_manifest(path).get("data") or {})
    return dict(read_checkpoint(path, "hieragent play").get("datamodule_hyper_parameters") or {})


def read_manifest(path: str | Path) -> dict[str, Any]:
    file = Path(path) / MANIFEST
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ValueError(f"exported agent '{path}': {MANIFEST} cannot be read ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != EXPORT_FORMAT:
        raise ValueError(f"exported agent '{path}': {MANIFEST} is not format {EXPORT_FORMAT}; "
                         "export it again with this version of hieragent")
    return manifest


def load_export(module, path: str | Path) -> None:
    """Adapters, query adapter, value head and bank of an exported folder into ``module``
    (``model.init_from DIR``); each missing or mismatched part is a one-line error."""
    path = Path(path)
    manifest = read_manifest(path)
    what = f"model.init_from '{path}'"
    for role, _ in module.policies():
        if role not in manifest["roles"]:
            raise ValueError(f"{what} has no {role} adapter (it holds {manifest['roles']}); "
                             "was it exported from a flat run?")
        weights = path / role / "adapter_model.safetensors"
        if not weights.is_file():
            raise FileNotFoundError(f"{what}: {weights} is missing")
        result = set_peft_model_state_dict(module.lm, load_file(weights), adapter_name=role)
        missing = [k for k in result.missing_keys if f".{role}." in k and "lora_" in k]
        if missing:
            raise ValueError(f"{what}: the {role} adapter lacks {len(missing)} weights this model "
                             f"expects (first: {missing[0]}); another model or lora config?")
    for name, part in _parts(module).items():
        file = path / f"{name}.safetensors"
        if part is not None and file.is_file():
            try:
                part.load_state_dict(load_file(file))
            except RuntimeError as err:
                raise ValueError(f"{what}: {file.name} does not fit this model ({err})") from None
    if module.bank is not None and (path / "bank").is_dir():
        from hieragent.memory.bank import MemoryBank

        module.bank.load_state_dict(MemoryBank.load(path / "bank").state_dict())

