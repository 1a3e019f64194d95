"""Wheel smoke test (wheels.yml, `make smoke-wheel`, `make wheel-portable`): the installed wheel
imports, tokenizes, and decodes a few greedy tokens on the model from the `lloyal[model]` extra.

With LLOYAL_EXPECT_PORTABLE=1 it also checks that the wheel is portable and that llama.cpp picked
a CPU backend that uses what this CPU has (AVX2, AVX-512, AMX), not the baseline one."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import lloyal

info = lloyal.system_info()
print(f"system_info: {info}")
if os.environ.get("LLOYAL_EXPECT_PORTABLE") == "1":
    assert lloyal._lloyal.PORTABLE, "not a portable build (feature `portable`)"
    assert "site-packages" in lloyal.__file__, f"imported {lloyal.__file__}, not the installed wheel"
    cpuinfo = Path("/proc/cpuinfo")
    flags = set(cpuinfo.read_text().split()) if cpuinfo.exists() else set()
    # AMX too: its module variant is the one GCC's _tile_loadconfig broke (llama-build/).
    checks = [("avx2", "AVX2 = 1"), ("avx512f", "AVX512 = 1"), ("fma", "FMA = 1")]
    checks.append(("amx_int8", "AMX_INT8 = 1"))
    for flag, feature in checks:
        if flag in flags:
            assert feature in info, f"this CPU has {flag} but llama.cpp's backend lacks {feature!r}"
    if "avx512f" in flags and not os.environ.get("LLOYAL_CPUINFO"):
        # As on a host whose OS has not enabled AVX-512 (CPUID still reports it): a /proc/cpuinfo
        # without the avx512*/amx* flags must keep llama.cpp off the modules that use them.
        with tempfile.TemporaryDirectory() as tmp:
            fake = Path(tmp) / "cpuinfo"
            fake.write_text(
                "\n".join(
                    " ".join(f for f in line.split() if not f.startswith(("avx512", "amx")))
                    for line in cpuinfo.read_text().splitlines()
                )
            )
            code = "import lloyal; print(lloyal.system_info())"
            env = {**os.environ, "LLOYAL_CPUINFO": str(fake)}
            out = subprocess.run(
                [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
            )
            assert "AVX2 = 1" in out.stdout and "AVX512" not in out.stdout, out.stdout
            print(f"without avx512 in /proc/cpuinfo: {out.stdout.strip()}")

path = lloyal.default_model_path()
with lloyal.Context(path, n_ctx=256, n_seq_max=2) as ctx:
    tokens = ctx.tokenize("The capital of France is")
    assert tokens and all(0 <= t < ctx.n_vocab for t in tokens), tokens
    assert ctx.detokenize(tokens, special=False).endswith("The capital of France is")
    with lloyal.Branch.create(ctx, 0, lloyal.SamplingParams(temperature=0)) as branch:
        branch.prefill(tokens)
        fork = branch.fork()
        generated = [tok.token for tok in branch.generate(4)]
        again = [tok.token for tok in fork.generate(4)]
        assert generated and generated == again, (generated, again)  # a fork continues identically
        assert branch.position == len(tokens) + len(generated)
        text = ctx.detokenize(generated)
print(f"lloyal {lloyal.__version__} wheel OK: {path.name}, {len(tokens)} prompt tokens, greedy {text!r}")
