#!/usr/bin/env bash
# The calls of a GPU lease, run on the lent machine from the repository root (the device tool
# copies the working tree there), after benches/gpu_lease_prep.sh here:
#
#   bash benches/gpu_lease.sh setup        carry .dev: installs the wheel and the test
#                                          dependencies into /tmp/site, the fixtures into
#                                          ~/.cache/lloyal, and starts the CUDA build of
#                                          benches/gpu_backend.sh in the background (~190 s),
#                                          unless .dev says the build comes prebuilt
#                                          (benches/gpu_prebuild.sh here)
#   bash benches/gpu_lease.sh part N       carry .devN (N = 2, 3, ...): the model's next part,
#                                          or the prebuilt build's; each call within the
#                                          machine's 30 s idle window
#   bash benches/gpu_lease.sh bench        installs the prebuilt build (or, if it does not
#                                          load, builds now) or waits for the build, checks the
#                                          model, then benches/gpu_suite.sh $OUT/r 0 bench
#   bash benches/gpu_lease.sh tests        benches/gpu_suite.sh $OUT/r 560 tests
#   bash benches/gpu_lease.sh server       lloyal serve vs llama-server (the prebuilt one, on the
#                                          same ggml), -ngl 99 both: gpu_suite.sh's `server` part
#   bash benches/gpu_lease.sh cputests [S] the suite on the host's CPU (AMX on the lent Xeons),
#                                          the CUDA module set aside meanwhile, S seconds at most
#                                          (540; it took over 420 s there): call with timeout_s 600
set -euo pipefail
w=/tmp/w
site=/tmp/site
# ggml's CUDA module and llama-batched-bench built here, in the background.
build_in_background() {
    export PATH=$PATH:/usr/local/cuda/bin
    setsid nohup bash -c "CPU_VARIANTS=avx2 bash $w/repo/benches/gpu_backend.sh $w/src/llama.cpp $w/src/batched-bench \
        $w/build $site/lloyal/_native > $w/build.log 2>&1; echo BUILD-EXIT \$? >> $w/build.log" \
        > /dev/null 2>&1 < /dev/null &
}
# The prebuilt build (benches/gpu_prebuild.sh) into the build's place and the wheel, if it
# arrived whole and both the wheel and the bench see the GPU with it.
install_prebuilt() {
    (cd "$w" && sha256sum -c cuda.sha256) || return 1
    tar -xJf "$w/cuda.tar.xz" -C / && cp "$w/build/build/bin/libggml-cuda.so" "$site/lloyal/_native/" || return 1
    python3 -c "import lloyal, sys; i = lloyal.system_info(); print(i[:80]); sys.exit('CUDA' not in i)" || return 1
    "$LLAMA_BATCHED_BENCH" --list-devices 2>&1 | grep -m 1 CUDA || return 1
    echo "BUILD-EXIT 0 (prebuilt: $(cat "$w/build/build/bin/PREBUILT"))" >> "$w/build.log"
}
case "${1:?usage: benches/gpu_lease.sh setup | part N | bench | tests | server | cputests}" in
setup)
    mkdir -p "$w/src" "$w/repo"
    cp -r .dev/. "$w/"
    cp -r benches llama-build "$w/repo/" # the build outlives this call's copy of the tree
    tar -xJf "$w/src.tar.xz" -C "$w/src"
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$w"/lloyal-*.whl "$w"/whl/*.whl
    mkdir -p ~/.cache/lloyal && tar -xJf "$w/cache.tar.xz" -C ~/.cache/lloyal
    mv "$w/m.00" "$w/model.gguf"
    if [ -f "$w/cuda.sha256" ]; then
        echo "the CUDA build comes prebuilt, in parts" > "$w/build.log"
    else
        build_in_background
    fi
    nproc && nvidia-smi -L
    ;;
part)
    dir=".dev${2:?part number}"
    if ls "$dir"/m.* > /dev/null 2>&1; then cat "$dir"/m.* >> "$w/model.gguf" && ls -l "$w/model.gguf"; fi
    if ls "$dir"/c.* > /dev/null 2>&1; then cat "$dir"/c.* >> "$w/cuda.tar.xz" && ls -l "$w/cuda.tar.xz"; fi
    tail -c 200 "$w/build.log"
    ;;
bench | tests | server | cputests)
    export PYTHONPATH=$site PATH=$site/bin:$PATH:/usr/local/cuda/bin LLOYAL_MODEL=$w/model.gguf
    export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export LLAMA_BATCHED_BENCH=$w/build/build/bin/llama-batched-bench
    # The prebuilt CUDA build, installed by whichever of these calls comes first.
    if [ -f "$w/cuda.sha256" ] && ! grep -q BUILD-EXIT "$w/build.log"; then
        install_prebuilt || build_in_background
    fi
    if [ "$1" = server ]; then
        LLAMA_SERVER=$w/build/build/bin/llama-server bash benches/gpu_suite.sh "$OUT/r" 0 server
        exit 0
    fi
    if [ "$1" = cputests ]; then
        mv "$site/lloyal/_native/libggml-cuda.so" "$w/"
        bash benches/gpu_suite.sh "$OUT/r" "${2:-540}" cpu || true
        mv "$w/libggml-cuda.so" "$site/lloyal/_native/"
        exit 0
    fi
    if [ "$1" = bench ]; then
        sed "s|  .*|  $w/model.gguf|" "$w/model.sha256" | sha256sum -c
        t0=$(date +%s)
        until grep -q BUILD-EXIT "$w/build.log"; do
            sleep 3
            [ $(($(date +%s) - t0)) -gt 300 ] && break
        done
        tail -n 3 "$w/build.log" && cp "$w/build.log" "$OUT/"
        bash benches/gpu_suite.sh "$OUT/r" 0 bench
    else
        bash benches/gpu_suite.sh "$OUT/r" 560 tests
    fi
    ;;
esac
