"""One base model, named LoRA adapters (PEFT multi-adapter).

The planner and the executor are adapters on one causal LM. The reference policy for the
KL term is the same model with adapters disabled, so no second copy sits in memory; after a
warm start it is a frozen copy of each warm-start adapter, ``<name>_ref`` (a few MB).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from peft import LoraConfig, PeftModel, get_peft_model
from transformers import PreTrainedModel


@dataclass
class LoraSettings:
    """LoRA hyper-parameters shared by every adapter.

    Attributes:
        r: Rank of the update.
        alpha: Scaling numerator (the update is scaled by alpha / r).
        dropout: Dropout on the adapter's input; 0 keeps rollout and training identical.
        target_modules: Names of the linear layers that get an adapter.
    """

    r: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )


REFERENCE_SUFFIX = "_ref"


def _config(settings: LoraSettings) -> LoraConfig:
    return LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules),
        task_type="CAUSAL_LM",
    )


@contextmanager
def _tied_head_allowed() -> Iterator[None]:
    """An adapted output head of a tied model (``target_modules`` with ``lm_head``): PEFT
    warns about merging and format conversion, neither of which hieragent does (adapters
    are saved as they are, see ``lightning/export.py``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*tied layer is part of the adapter", category=UserWarning)
        yield


def add_adapters(model: PreTrainedModel, names: list[str], settings: LoraSettings) -> PeftModel:
    """Wrap ``model`` with one LoRA adapter per name; the base weights are frozen."""
    if not names:
        raise ValueError("add_adapters needs at least one adapter name")
    config = _config(settings)
    with _tied_head_allowed():
        peft_model = get_peft_model(model, config, adapter_name=names[0])
        for name in names[1:]:
            peft_model.add_adapter(name, config)
    # PEFT marks only the active adapter trainable; both policies train jointly.
    for pname, param in peft_model.named_parameters():
        param.requires_grad_(any(f".{n}." in pname for n in names) and "lora_" in pname)
    return peft_model


def adapter_parameters(model: PeftModel, name: str) -> list:
    """The trainable parameters of one adapter, for its own optimizer param group."""
    return [p for n, p in model.named_parameters() if "lora_" in n and f".{name}." in n]


def add_reference_adapters(model: PeftModel, names: list[str], settings: LoraSettings) -> list[str]:
    """A frozen copy of each named adapter as it is now, named ``<name>_ref``; returns the names.

    The copies are the KL reference after a warm start: the policy RL starts from, not the
    base model before supervised training. They never train (``requires_grad`` off, and
    ``adapter_parameters`` of a policy never matches them).
    """
    current = dict(model.named_parameters())
    refs = []
    for name in names:
        ref = f"{name}{REFERENCE_SUFFIX}"
        with _tied_head_allowed():
            model.add_adapter(ref, _config(settings))
        refs.append(ref)
    for pname, param in model.named_parameters():
        for name, ref in zip(names, refs):
            if f".{ref}." in pname:
                param.data.copy_(current[pname.replace(f".{ref}.", f".{name}.")].detach())
        param.requires_grad_("lora_" in pname and any(f".{n}." in pname for n in names))
    return refs
