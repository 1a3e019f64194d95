#!/usr/bin/env bash
# On a GPU host, after benches/gpu_backend.sh: the CUDA build checked, timed against
# llama-batched-bench on the same ggml, and the test suite run with every layer on the GPU.
#
#   LLOYAL_MODEL=... LLAMA_BATCHED_BENCH=... benches/gpu_suite.sh OUT [TEST_SECONDS] [PART]
#   (DEADLINE=<epoch seconds>: the tests get what is left until then instead; PART: `bench` for
#   everything but the tests, `tests` for the tests alone, both by default. The suite took ~330 s
#   on an H200 and the benches ~130 s, so with a 600 s limit a call, a lease that also waits for
#   the CUDA build runs them as two calls: `... OUT 0 bench`, then `... OUT 560 tests`.)
#
# Writes into OUT: gpu.txt (the card), gpu_check.txt (greedy tokens, forks, perplexities with
# --ngl 99 and --ngl 0), side_by_side.md/.json (benches/batched_side_by_side.py: prefill, decode
# B=1/16, sampled streams, 3 paired rounds, 8 threads; lloyal with host rows and with
# LLOYAL_DEVICE_ROWS=1), prefill_probe.md (benches/prefill_probe.py: the 512-token prefill by path
# and context shape, wall and in-llama_decode), host_work.md (benches/bench_host_work.py on the GPU, both ways), with
# $LLAMA_SERVER set server.md/.json (benches/bench_server.py, shared prefix, 2 paired rounds,
# -ngl 99 on both) and pytest.txt (tests/ with LLOYAL_N_GPU_LAYERS=99, stopped after
# TEST_SECONDS, default 300; tests/test_ray.py left out: Ray is not installed there).
# PART `server`: the server comparison alone (needs LLAMA_SERVER); `cpu`: the suite on the CPU
# (pytest_cpu.txt, cpu_info.txt), for a caller that has set the GPU backend aside.
set -uo pipefail
out=${1:?usage: benches/gpu_suite.sh OUT [TEST_SECONDS] [bench|tests]}
test_seconds=${2:-300}
part=${3:-all}
py=${PYTHON:-python3}
cd "$(dirname "$0")/.."
mkdir -p "$out"
export PYTHONUNBUFFERED=1
step() { echo "== $(date +%T) $*"; }
if [ "$part" = all ] || [ "$part" = bench ]; then
step card
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
step gpu_check
{ timeout 60 $py benches/gpu_check.py --ngl 99 && timeout 60 $py benches/gpu_check.py --ngl 0; } > "$out/gpu_check.txt" 2>&1
tail -n 4 "$out/gpu_check.txt"
step side by side
timeout 240 $py benches/batched_side_by_side.py --rounds 3 --pp 512 --tg 128 --batch 1,16 --threads 8 --ngl 99 \
    --modes lloyal,lloyal-no-spin,lloyal-device-rows --bin "$LLAMA_BATCHED_BENCH" --json "$out/side_by_side.json" > "$out/side_by_side.md" 2>&1
cat "$out/side_by_side.md"
step prefill probe
timeout 150 $py benches/prefill_probe.py --ngl 99 --threads 8 --rounds 7 --debug-dir "$out/sched" > "$out/prefill_probe.md" 2>&1
cat "$out/prefill_probe.md"
tar -czf "$out/sched.tgz" -C "$out" sched && rm -rf "$out/sched" # the 8 files a call brings back
step host work
LLOYAL_N_GPU_LAYERS=99 timeout 60 $py benches/bench_host_work.py 64 1 16 > "$out/host_work.md" 2>&1
echo "with LLOYAL_DEVICE_ROWS=1:" >> "$out/host_work.md"
LLOYAL_DEVICE_ROWS=1 LLOYAL_N_GPU_LAYERS=99 timeout 60 $py benches/bench_host_work.py 64 1 16 >> "$out/host_work.md" 2>&1
cat "$out/host_work.md"
fi
if [ -n "${LLAMA_SERVER:-}" ] && { [ "$part" = all ] || [ "$part" = server ]; }; then
    # llama-server on the same ggml (benches/gpu_prebuild.sh: llama-cpp-python's server sources
    # on the crate's llama.cpp, as benches/cpu_peer_server.sh), loading the same CUDA module.
    step "lloyal serve vs llama-server"
    timeout 400 $py benches/bench_server.py --full --loads shared-prefix --only lloyal,llama-server \
        --rounds 2 --ngl 99 --json "$out/server.json" > "$out/server.md" 2>&1
    tail -n 12 "$out/server.md"
fi
if [ "$part" = bench ] || [ "$part" = server ]; then step end; exit 0; fi
workers=$(($(nproc) / 2))
if [ "$part" = cpu ]; then
    # The suite on this host's CPU (the lent H200s' Xeons have AMX), no GPU backend loaded (the
    # caller sets the CUDA module aside): the same call as on CI, in workers of 2 threads.
    step "tests on the CPU (${test_seconds}s at most)"
    $py -c "import lloyal; print(lloyal.system_info())" | tee "$out/cpu_info.txt"
    grep -o 'AMX_INT8 = 1' "$out/cpu_info.txt" || echo "no AMX on this CPU"
    # -v: each test's outcome as it ends (session 48's run was stopped before pytest's summary)
    PYTHONPATH=benches:${PYTHONPATH:-} timeout "$test_seconds" $py -m pytest tests -v -p no:cacheprovider -rfE \
        -p no:benchmark -p xdist_pin -W ignore::DeprecationWarning -W ignore::PendingDeprecationWarning \
        --ignore tests/test_ray.py -n "$workers" --dist loadfile --durations 15 > "$out/pytest_cpu.txt" 2>&1
    echo "pytest exit $?"
    grep -E "FAILED|ERROR|node down" "$out/pytest_cpu.txt" | head -n 40
    tail -n 3 "$out/pytest_cpu.txt"
    step end
    exit 0
fi
if [ -n "${DEADLINE:-}" ]; then test_seconds=$((DEADLINE - $(date +%s) - 10)); fi
if [ "$test_seconds" -lt 30 ]; then step "no time left for the tests"; exit 0; fi
step "tests (${test_seconds}s at most)"
# pytest-xdist, one worker per 2 cores, each pinned to its 2 (benches/xdist_pin.py: threads as on
# CI's 2-core host, not 16 threads a worker on 16 cores); with xdist pytest-benchmark warns (an
# error here): no:benchmark. -W: the GPU image's own pytest plugins (other versions) may warn.
PYTHONPATH=benches:${PYTHONPATH:-} LLOYAL_N_GPU_LAYERS=99 timeout "$test_seconds" $py -m pytest tests -q \
    -p no:cacheprovider -rfE -p no:benchmark -p xdist_pin -W ignore::DeprecationWarning \
    -W ignore::PendingDeprecationWarning --ignore tests/test_ray.py -n "$workers" --dist loadfile \
    --durations 15 > "$out/pytest.txt" 2>&1
echo "pytest exit $?"
tail -n 40 "$out/pytest.txt"
step end
