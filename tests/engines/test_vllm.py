"""The vLLM engine: on a machine without a GPU or vllm it refuses in one line and writes
nothing; against a stand-in for vLLM's Python API, its version bookkeeping (adapters saved
per version, fresh LoRA ids, old ones unloaded, the lagged one served) and its reading of
vLLM's outputs."""

import json
import subprocess
import sys
import types

import pytest
import torch
from safetensors.torch import load_file

from hieragent.engines.base import EngineSettings, Request, Sampling
from hieragent.engines.vllm import EngineUnavailable, VLLMEngine

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the path of a machine without a GPU")


@no_gpu
def test_without_gpu_the_engine_names_model_engine_and_writes_nothing(tiny_lm, tmp_path):
    workdir = tmp_path / "engine"
    with pytest.raises(EngineUnavailable) as err:
        VLLMEngine(tiny_lm, tmp_path / "model", eos_id=2, workdir=workdir)
    message = str(err.value)
    assert isinstance(err.value, ValueError) and "\n" not in message
    assert "model.engine" in message and "GPU" in message and "model.engine: hf" in message
    assert list(tmp_path.iterdir()) == []


def test_without_vllm_the_engine_says_how_to_install_it(tiny_lm, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    with pytest.raises(EngineUnavailable, match=r"model\.engine.*hieragent\[vllm\]"):
        VLLMEngine(tiny_lm, tmp_path / "model", eos_id=2, workdir=tmp_path / "engine")
    assert list(tmp_path.iterdir()) == []


@no_gpu
def test_device_check_without_gpu_prints_one_line_exits_2_and_writes_no_json(tmp_path):
    out = tmp_path / "report.json"
    run = subprocess.run([sys.executable, "-m", "hieragent.bench.device_check", "--out", str(out)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    lines = (run.stdout + run.stderr).strip().splitlines()
    assert run.returncode == 2
    assert len(lines) == 1 and "GPU" in lines[0]
    assert list(tmp_path.iterdir()) == []  # neither --out nor the default device_check.json


# -- a stand-in for the parts of vLLM's API the engine uses ---------------------------
class FakeLogprob:
    def __init__(self, logprob):
        self.logprob = logprob


class FakeParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


class FakeLoRA:
    def __init__(self, lora_name, lora_int_id, lora_path):
        self.lora_name, self.lora_int_id, self.lora_path = lora_name, lora_int_id, lora_path


class FakeLLM:
    """Completes every prompt with [7, 8, eos]; token t has log-prob -t/10 when sampled and
    -t/100 in the prompt, so a test can tell which position was read."""

    def __init__(self, **kwargs):
        self.kwargs, self.calls, self.removed, self.resets = kwargs, [], [], 0
        self.llm_engine = types.SimpleNamespace(remove_lora=self.removed.append)

    def reset_prefix_cache(self):
        self.resets += 1

    def generate(self, prompts, params, lora_request=None, use_tqdm=True):
        params = params if isinstance(params, list) else [params] * len(prompts)
        self.calls.append((prompts, params, lora_request))
        outputs = []
        for prompt, p in zip(prompts, params):
            ids = prompt["prompt_token_ids"]
            new = [7, 8, 2][:p.max_tokens]
            done = types.SimpleNamespace(token_ids=new, logprobs=[{t: FakeLogprob(-t / 10)} for t in new],
                                         finish_reason="stop" if new[-1] == 2 else "length")
            prompt_logprobs = [None] + [{t: FakeLogprob(-t / 100)} for t in ids[1:]]
            outputs.append(types.SimpleNamespace(outputs=[done], prompt_logprobs=prompt_logprobs))
        return outputs


@pytest.fixture()
def fake_vllm(monkeypatch, tmp_path):
    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams = FakeLLM, FakeParams
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = dict  # a TypedDict in vLLM
    request = types.ModuleType("vllm.lora.request")
    request.LoRARequest = FakeLoRA
    modules = {"vllm": vllm, "vllm.inputs": inputs, "vllm.lora": types.ModuleType("vllm.lora"),
               "vllm.lora.request": request}
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 1024}))
    return model


def trainable(lm):
    return {n: p for n, p in lm.named_parameters() if "lora_" in n}


def test_engine_asks_vllm_for_processed_logprobs_and_lora_it_can_serve(tiny_lm, fake_vllm, tmp_path):
    engine = VLLMEngine(tiny_lm, fake_vllm, eos_id=2, workdir=tmp_path / "w", settings=EngineSettings(),
                        lag=1)
    kw = engine.llm.kwargs
    assert kw["logprobs_mode"] == "processed_logprobs" and kw["enable_lora"]
    assert kw["max_lora_rank"] == 8  # rank 4 rounded up to a rank vLLM accepts
    assert kw["max_model_len"] == 1024 and kw["dtype"] == "bfloat16"
    assert engine.adapters == ["planner", "executor"]
    with pytest.raises(RuntimeError, match="engine.sync"):
        engine.score([Request([1, 5], "planner")], [[[3]]])


def test_each_version_is_saved_once_served_while_kept_and_unloaded_after(tiny_lm, fake_vllm, tmp_path):
    workdir = tmp_path / "w"
    engine = VLLMEngine(tiny_lm, fake_vllm, eos_id=2, workdir=workdir, lag=1)
    params = trainable(tiny_lm)
    engine.sync(params, 1)
    saved = load_file(workdir / "v1" / "executor" / "adapter_model.safetensors")
    assert saved and all(t.dtype == torch.bfloat16 for t in saved.values())
    assert json.loads((workdir / "v1" / "executor" / "adapter_config.json").read_text())["r"] == 4
    with torch.no_grad():
        for p in params.values():
            p.add_(1.0)
    engine.sync(params, 2)
    request = [Request([1, 5, 6], "executor")]
    engine.score(request, [[[3]]])
    assert engine.llm.calls[-1][2].lora_path == str(workdir / "v2" / "executor")
    with engine.lagged():
        engine.score(request, [[[3]]])
    assert engine.llm.calls[-1][2].lora_path == str(workdir / "v1" / "executor")
    v1_ids = {lora.lora_int_id for (v, _), lora in engine._loras.items() if v == 1}
    engine.sync(params, 3)
    assert sorted(p.name for p in workdir.iterdir()) == ["v2", "v3"]
    engine.sync(params, 3)  # a re-sync of the latest version: new ids, the old ones unloaded
    engine.score(request, [[[3]]])
    ids = [lora.lora_int_id for lora in engine._loras.values()]
    assert len(set(ids)) == 4 and v1_ids <= set(engine.llm.removed) and not set(ids) & set(engine.llm.removed)
    assert len(engine.llm.removed) == 4 and engine.llm.resets == 2  # reset once per acting call after syncs
    assert sorted(p.name for p in workdir.iterdir()) == ["v2", "v3"]  # no temporary folder left


def test_generate_and_score_read_vllms_token_ids_and_logprobs(tiny_lm, fake_vllm, tmp_path):
    engine = VLLMEngine(tiny_lm, fake_vllm, eos_id=2, workdir=tmp_path / "w")
    engine.sync(trainable(tiny_lm), 1)
    requests = [Request([1, 5, 6], "planner", sampling=Sampling(0.7, 3)) for _ in range(4)]
    out = engine.generate(requests, torch.Generator().manual_seed(0))
    assert [g.ids for g in out] == [[7, 8, 2]] * 4 and {g.finish_reason for g in out} == {"stop"}
    assert out[0].logprobs == pytest.approx([-0.7, -0.8, -0.2])
    params = engine.llm.calls[-1][1]
    assert len({p.seed for p in params}) == 4  # equal prompts must not sample alike
    assert all(p.temperature == 0.7 and p.stop_token_ids == [2] and p.ignore_eos for p in params)
    again = engine.generate(requests, torch.Generator().manual_seed(0))
    assert [p.seed for p in engine.llm.calls[-1][1]] == [p.seed for p in params] and again == out
    engine.generate([Request([1], "planner", sampling=Sampling(0.7, 2, greedy=True))])
    assert engine.llm.calls[-1][1][0].temperature == 0.0
    scores = engine.score([Request([1, 5], "planner"), Request([4], "planner")], [[[3, 9], [6]], [[8]]])
    got = [[t.tolist() for t in row] for row in scores]  # the continuation's tokens, after the prompt
    assert got == [[pytest.approx([-0.03, -0.09]), pytest.approx([-0.06])], [pytest.approx([-0.08])]]
    assert all(t.dtype == torch.float32 for row in scores for t in row)
    with pytest.raises(ValueError, match="one adapter"):
        engine.score([Request([1], "planner"), Request([1], "executor")], [[[3]], [[3]]])
