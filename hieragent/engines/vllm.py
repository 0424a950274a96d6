"""The vLLM acting engine (``model.engine: vllm``): one CUDA GPU, the ``vllm`` extra.

The base model is loaded once by vLLM; the planner and executor are LoRA adapters that
the trainer's PEFT model writes to ``workdir/v{version}/{adapter}`` at every sync and vLLM
serves per request (``LoRARequest``). Token ids go in and come out (``TokensPrompt``);
nothing is re-tokenised.

Log-probabilities:

* ``generate`` records the log-prob of each sampled token under the distribution it was
  sampled from, ``log softmax(logits / T)``: the engine runs with
  ``logprobs_mode="processed_logprobs"`` (vLLM >= 0.10.2 applies the temperature there)
  and no top-k/top-p, which is what the trainer recomputes. Greedy decoding runs at
  vLLM's temperature 0, whose processed log-probs are ``log softmax(logits)``, at
  temperature 1: the HF engine records ``log softmax(logits / T)`` instead. Greedy is
  evaluation only, whose log-probs are never trained on, so the two agree exactly only
  when ``T == 1``.
* ``score`` reads vLLM's prompt log-probs of prompt + continuation, which are always
  of the raw distribution (temperature 1), as ``Engine.score`` asks. vLLM does not reuse
  cached prefixes for requests that want prompt log-probs, so each candidate runs its
  whole prompt; acceptable for short prompts, the HF engine is faster for many candidates.

Versions: each synced version is saved once, at its sync, and kept while it is in
``self.versions``; inside ``lagged()`` the oldest kept is served. Changes on the vLLM side
(unloading old adapters, resetting the prefix cache) wait for the next acting call, so a
sync while the engine sleeps touches no GPU memory.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import uuid
from pathlib import Path

import torch
from torch import Tensor

from hieragent.engines.base import (Engine, EngineSettings, Generation, Request, check_continuations, one_adapter,
                                   one_sampling, per_request)
from hieragent.io import scratch_dir
from hieragent.models.lora import REFERENCE_SUFFIX
from hieragent.sampling import Randomness, per_row

MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's LoRAConfig.max_lora_rank choices
DTYPES = ("bfloat16", "float16")  # vLLM's LoRA kernels have no float32 path
INSTALL = "pip install 'hieragent[vllm]'"


class EngineUnavailable(ValueError):
    """The vLLM engine cannot run on this machine; the message says what to do instead.

    A ``ValueError``, so the CLI prints it as one line and exits non-zero.
    """


def require_vllm():
    """The ``vllm`` module, or ``EngineUnavailable`` when there is no CUDA GPU or no vllm."""
    if not torch.cuda.is_available():
        raise EngineUnavailable(
            f"model.engine: vllm needs a CUDA GPU and the vllm extra ({INSTALL}); this machine "
            "has no CUDA GPU. Use model.engine: hf.")
    try:
        import vllm
    except (ImportError, OSError) as err:  # OSError: a vllm build whose CUDA libraries are missing
        raise EngineUnavailable(
            f"model.engine: vllm needs the vllm extra, which did not import ({err}); install it "
            f"with {INSTALL} (a CUDA build that matches this GPU's driver), or use model.engine: hf."
        ) from err
    return vllm


class VLLMEngine(Engine):
    """Acting with vLLM on one GPU, the trainer's adapters reloaded at every sync.

    Args:
        lm: The trainer's live PEFT model (its adapters are saved from it at each sync).
        model_path: Local Hugging Face directory of the base model (``smollm2_dir()``).
        eos_id: End-of-turn token id: a completion stops after it (and only after it).
        workdir: Where the synced adapters are written (``v{version}/{adapter}``).
        settings: Engine settings (GPU memory share, sleep mode, prefix cache, max length).
        lag: Versions the lagged weights are behind (``Engine``).
        lora_rank: Rank of the adapters; ``None``: the largest ``r`` of ``lm``'s adapters.
        dtype: vLLM's weights and activations, ``bfloat16`` or ``float16``.
        adapters: The adapters served; ``None``: every adapter of ``lm`` but the frozen
            ``*_ref`` copies (the trainer computes the KL reference itself).
        enforce_eager: Skip CUDA-graph capture: faster start, slower decoding.
    """

    name = "vllm"

    def __init__(self, lm: torch.nn.Module, model_path: str | os.PathLike, eos_id: int,
                 workdir: str | os.PathLike, settings: EngineSettings = EngineSettings(), lag: int = 0,
                 lora_rank: int | None = None, dtype: str = "bfloat16", adapters: list[str] | None = None,
                 enforce_eager: bool = False) -> None:
        super().__init__(settings, lag)
        vllm = require_vllm()  # before anything touches the disk
        from vllm.inputs import TokensPrompt
        from vllm.lora.request import LoRARequest

        if dtype not in DTYPES:
            raise ValueError(f"vllm engine dtype must be one of {DTYPES} (vLLM's LoRA has no float32), "
                             f"got {dtype!r}")
        configs = getattr(lm, "peft_config", None)
        if not configs:
            raise ValueError("the vllm engine serves LoRA adapters: lm must be a PEFT model with adapters")
        self.adapters = adapters or [n for n in configs if not n.endswith(REFERENCE_SUFFIX)]
        if unknown := sorted(set(self.adapters) - set(configs)):
            raise ValueError(f"vllm engine: lm has no adapter {unknown}; it has {sorted(configs)}")
        rank = lora_rank if lora_rank is not None else max(configs[a].r for a in self.adapters)
        max_rank = next((r for r in MAX_LORA_RANKS if r >= rank), None)
        if max_rank is None:
            raise ValueError(f"vllm serves LoRA ranks up to {MAX_LORA_RANKS[-1]}, got {rank}")
        model_path = Path(model_path)
        if not (model_path / "config.json").is_file():
            raise FileNotFoundError(f"vllm engine: {model_path} has no config.json; give a local "
                                    "Hugging Face directory (e.g. hieragent.models.loading.smollm2_dir())")
        positions = json.loads((model_path / "config.json").read_text()).get("max_position_embeddings")

        self.lm, self.eos_id, self.dtype = lm, eos_id, getattr(torch, dtype)
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._TokensPrompt, self._LoRARequest = TokensPrompt, LoRARequest
        self._SamplingParams = vllm.SamplingParams
        n = len(self.adapters)
        self.llm = vllm.LLM(
            model=str(model_path), dtype=dtype, seed=0,
            enable_lora=True, max_lora_rank=max_rank,
            max_loras=n,  # one batch runs one adapter; a slot each avoids reloading on every switch
            max_cpu_loras=n * (lag + 2),  # the kept versions and the one replaced at a sync
            gpu_memory_utilization=settings.gpu_memory_utilization,
            max_model_len=min(settings.max_model_len, positions or settings.max_model_len),
            enable_prefix_caching=settings.prefix_cache,
            enable_sleep_mode=settings.sleep,
            logprobs_mode="processed_logprobs",
            generation_config="vllm",  # the model's generation_config.json may not change sampling
            enforce_eager=enforce_eager,
        )
        self._ids = itertools.count(1)
        self._loras: dict[tuple[int, str], object] = {}  # (version, adapter) -> LoRARequest
        self._saved: set[int] = set()
        self._stale: list[int] = []  # lora_int_ids to unload at the next acting call
        self._reset_cache = False
        self._asleep = False

    # -- versions ----------------------------------------------------------------------
    def on_sync(self, version: int) -> None:
        target = self.workdir / f"v{version}"
        self._save(target)
        kept = set(self.versions) - {version}  # a re-synced version has new weights
        for key in [k for k in self._loras if k[0] not in kept]:
            self._stale.append(self._loras.pop(key).lora_int_id)
        for adapter in self.adapters:
            i = next(self._ids)
            # LoRARequests compare by name: one name per version and id, never reused
            name = f"{adapter}-v{version}-{i}"
            self._loras[(version, adapter)] = self._LoRARequest(name, i, str(target / adapter))
        for old in self._saved - set(self.versions):
            shutil.rmtree(self.workdir / f"v{old}", ignore_errors=True)
        self._saved = (self._saved & set(self.versions)) | {version}
        self._reset_cache = True

    def _save(self, target: Path) -> None:
        """Write every served adapter (safetensors, in the engine's dtype) to ``target``, atomically."""
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        with scratch_dir(target, prefix=f".{target.name}.tmp-") as tmp:
            for adapter in self.adapters:
                state = get_peft_model_state_dict(self.lm, adapter_name=adapter)
                state = {k: v.detach().to("cpu", self.dtype).contiguous() for k, v in state.items()}
                (tmp / adapter).mkdir()
                save_file(state, str(tmp / adapter / "adapter_model.safetensors"))
                self.lm.peft_config[adapter].save_pretrained(str(tmp / adapter))
            if target.exists():  # a re-sync: a directory cannot be renamed over a non-empty one
                old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
                os.replace(target, old)
                shutil.rmtree(old, ignore_errors=True)
            os.replace(tmp, target)

    def _lora(self, adapter: str):
        """The LoRARequest of ``adapter`` at the version served, after pending vLLM updates."""
        if self._asleep:
            self.wake()
        if self._stale:
            remove = getattr(self.llm.llm_engine, "remove_lora", None)
            for lora_id in self._stale if remove is not None else ():
                remove(lora_id)  # without it, vLLM's LRU evicts them (max_cpu_loras)
            self._stale.clear()
        if self._reset_cache:
            self.llm.reset_prefix_cache()
            self._reset_cache = False
        if not self.versions:
            raise RuntimeError("vllm engine: no weights synced yet; call engine.sync(params, version) "
                               "before acting")
        if (self.version, adapter) not in self._loras:
            raise ValueError(f"vllm engine serves adapters {self.adapters}, not {adapter!r}")
        return self._loras[(self.version, adapter)]

    # -- acting ------------------------------------------------------------------------
    def generate(self, requests: list[Request], generator: Randomness = None) -> list[Generation]:
        if not requests:
            return []
        adapter, sampling = one_sampling(requests)
        lora = self._lora(adapter)
        # one seed per request: equal prompts (a group of rollouts) must not sample alike
        if sampling.greedy:
            seeds = [None] * len(requests)
        elif per_row(generator):  # each episode's seed from its own stream
            seeds = [int(torch.randint(2**31 - 1, (1,), generator=g)) for g in generator]
        else:
            seeds = torch.randint(2**31 - 1, (len(requests),), generator=generator).tolist()
        params = [self._SamplingParams(
            n=1, temperature=0.0 if sampling.greedy else sampling.temperature,
            max_tokens=sampling.max_new_tokens, logprobs=0, seed=seed,
            stop_token_ids=[self.eos_id], ignore_eos=True,  # stop at eos_id only, as the HF engine
            detokenize=False) for seed in seeds]
        prompts = [self._TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in requests]
        outputs = self.llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
        generations = []
        for out in outputs:
            done = out.outputs[0]
            ids = list(done.token_ids)
            logprobs = [float(step[token].logprob) for step, token in zip(done.logprobs, ids)]
            if len(logprobs) != len(ids) or done.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"vllm returned {len(ids)} tokens with {len(logprobs)} log-probs, "
                                   f"finish reason {done.finish_reason!r}")
            generations.append(Generation(ids, logprobs, done.finish_reason))
        return generations

    def score(self, requests: list[Request], continuations: list[list[list[int]]]) -> list[list[Tensor]]:
        if not requests:
            return []
        check_continuations(continuations)
        if any(not r.prompt_ids for r in requests):
            raise ValueError("engine.score: every request needs a non-empty prompt")
        lora = self._lora(one_adapter(requests))
        prompts, spans = [], []
        for r, cands in zip(requests, continuations):
            for c in cands:
                prompts.append(self._TokensPrompt(prompt_token_ids=list(r.prompt_ids) + list(c)))
                spans.append((len(r.prompt_ids), list(c)))
        # prompt_logprobs=0: the log-prob of each given token (of the raw distribution);
        # the one token generated after it is thrown away
        params = self._SamplingParams(temperature=1.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
        outputs = self.llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
        flat = [torch.tensor([out.prompt_logprobs[start + j][token].logprob for j, token in enumerate(c)],
                             dtype=torch.float32)
                for out, (start, c) in zip(outputs, spans)]
        return per_request(flat, continuations)

    # -- memory ------------------------------------------------------------------------
    def sleep(self) -> None:
        """Level 1: vLLM's weights go to CPU memory and its KV cache is dropped."""
        if self.settings.sleep and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True

    def wake(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False
            self._reset_cache = True
