#!/usr/bin/env bash
# Everything a lent GPU machine needs (it reaches no network), in folders the device tool can
# carry (64 MiB a call), ignored by git (`/.dev*/` in .git/info/exclude):
#
#   .dev     the portable wheel (`make wheel-portable`), src.tar.xz (llama.cpp as llama-cpp-sys-2
#            vendors it with only its CPU and CUDA backends, and llama-batched-bench's source from
#            llama-cpp-python's sdist: `make bench-peers-cpp` unpacks it), whl/ (the test suite's
#            pure-Python and CPython 3.12 dependencies, with theirs, numpy aside), cache.tar.xz (the
#            test fixtures in ~/.cache/lloyal), m.00 and model.sha256 (the model's first 30 MiB)
#   .dev2..  the rest of the model, 56 MB a folder; then, when benches/gpu_prebuild.sh has built
#            ggml's CUDA module and llama-batched-bench from this llama.cpp, that build (c.NN,
#            56 MB a folder; cuda.sha256 in .dev), which spares the lease its ~200 s build
#
#   benches/gpu_lease_prep.sh            (then the calls in docs/performance.md, "GPU")
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qxF '/.dev*/' .git/info/exclude 2>/dev/null || echo '/.dev*/' >> .git/info/exclude
rm -rf .dev .dev[0-9]*
mkdir -p .dev/whl

make wheel-portable
cp target/portable/dist/lloyal-*.whl .dev/

source benches/peer_source.sh
peer_inputs
src=$(mktemp -d)
cp -r "$llama_cpp" "$src/llama.cpp" && cp -r "$batched_bench" "$src/batched-bench"
for backend in "$src"/llama.cpp/ggml/src/ggml-*/; do
    case "$(basename "$backend")" in ggml-cpu | ggml-cuda) ;; *) rm -rf "$backend" ;; esac
done
tar -cJf .dev/src.tar.xz -C "$src" . && rm -rf "$src"

# With their dependencies (FastAPI 0.165 imports opentelemetry, openai 3 httpx2), but not numpy:
# the GPU image has one, and 16 MB more would not fit the 64 MiB a call carries.
.venv/bin/python -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d .dev/whl \
    fastapi starlette uvicorn openai jiter distro sniffio pydantic pydantic-core annotated-types \
    annotated-doc typing-extensions typing-inspection jsonschema jsonschema-specifications \
    referencing rpds-py gguf
rm -f .dev/whl/numpy-*.whl

tar -cJf .dev/cache.tar.xz -C ~/.cache/lloyal gguf-families llama-grammars

model=$(.venv/bin/python -c "import lloyal; print(lloyal.default_model_path())")
sha256sum "$model" > .dev/model.sha256
head -c 26214400 "$model" > .dev/m.00
tail -c +26214401 "$model" | split -b 56000000 -d -a 2 --numeric-suffixes=1 - .dev/m.
for part in .dev/m.[0-9][0-9]; do
    n=$((10#${part##*.}))
    [ "$n" -eq 0 ] && continue
    mkdir -p ".dev$((n + 1))" && mv "$part" ".dev$((n + 1))/"
done
prebuilt=tmp/w/build/build/bin
if [ "$(cat "/$prebuilt/PREBUILT" 2>/dev/null)" = "llama-cpp-sys-2 $llama_version" ]; then
    tar -cJf .dev/cuda.tar.xz -C / "$prebuilt"
    (cd .dev && sha256sum cuda.tar.xz > cuda.sha256)
    last=$(ls -d .dev[0-9]* | sed 's/^.dev//' | sort -n | tail -n 1)
    split -b 56000000 -d -a 2 .dev/cuda.tar.xz .dev/c. && rm .dev/cuda.tar.xz
    for part in .dev/c.[0-9][0-9]; do
        n=$((10#${part##*.} + last + 1))
        mkdir -p ".dev$n" && mv "$part" ".dev$n/"
    done
else
    echo "no prebuilt CUDA build for llama-cpp-sys-2 $llama_version (benches/gpu_prebuild.sh): the lease builds it"
fi
du -sh .dev .dev[0-9]* | sed 's/^/carry: /'
