"""Constrained decoding side by side: lloyal's grammar engines and llama-cpp-python's
``LlamaGrammar``, each measurement in its own process with a clean environment.

    python benches/grammar_side_by_side.py [--rounds 3] [--tokens 48] [--engines lloyal,lloyal-gbnf,...]

Engines: ``lloyal`` (unconstrained), ``lloyal-gbnf`` (GBNF text, translated onto llguidance),
``lloyal-gbnf-llama`` (the same GBNF on llama.cpp's grammar engine), ``lloyal-llguidance``
(``Grammar.from_json_schema``), ``llama-cpp-python`` and ``llama-cpp-python-grammar``. Grammars:
the JSON schemas ``issue``, ``nested`` and ``tagged`` (through ``json_schema_to_grammar`` for the
GBNF engines) and llama.cpp's hand-written ``arithmetic`` and ``list`` GBNF files.

Every (engine, prompt, schema) runs once per round in a fresh process (model load and grammar
compile outside the timing; lloyal's process-wide ``GGML_CPU_TILED_MM=0`` never reaches the
peer), rounds interleaved. Printed: median tok/s over rounds and its ratio to the same library's
unconstrained run on the same prompt. Temperature 0.7, top-k 40, top-p 0.95, seed 5.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parents[1] / "tests"))
from bench_grammar import ISSUE_SCHEMA, NESTED_SCHEMA, PROMPTS, TAGGED_SCHEMA
from llama_grammars import grammars as llama_cpp_grammars

SCHEMAS = {"issue": ISSUE_SCHEMA, "nested": NESTED_SCHEMA, "tagged": TAGGED_SCHEMA}
GBNF_FILES = ("arithmetic", "list")  # llama.cpp's grammars/ files: GBNF engines only
FREE = ("lloyal", "llama-cpp-python")  # unconstrained: once per prompt
ENGINES = [
    "lloyal",
    "lloyal-gbnf",
    "lloyal-gbnf-llama",
    "lloyal-llguidance",
    "llama-cpp-python",
    "llama-cpp-python-grammar",
]


def gbnf_of(grammar: str) -> str:
    if grammar in GBNF_FILES:
        return llama_cpp_grammars()[grammar]
    import lloyal

    return lloyal.json_schema_to_grammar(SCHEMAS[grammar])


def applies(engine: str, grammar: str) -> bool:
    if engine in FREE:
        return grammar == "issue"
    return grammar not in GBNF_FILES or engine != "lloyal-llguidance"


def worker(engine: str, prompt: str, schema: str, n: int, model: str) -> dict[str, float]:
    text = PROMPTS[prompt]
    if engine.startswith("lloyal"):
        import lloyal

        ctx = lloyal.Context(model, n_ctx=512, n_threads=2)
        grammar: object = None
        if engine == "lloyal-gbnf":
            grammar = lloyal.Grammar.from_gbnf(ctx, gbnf_of(schema))
            assert grammar.engine == "llguidance", grammar.fallback  # type: ignore[attr-defined]
        elif engine == "lloyal-gbnf-llama":
            grammar = lloyal.Grammar.from_gbnf(ctx, gbnf_of(schema), engine="llama.cpp")
        elif engine == "lloyal-llguidance":
            grammar = lloyal.Grammar.from_json_schema(ctx, SCHEMAS[schema])
        params = lloyal.SamplingParams(temperature=0.7, top_k=40, top_p=0.95, seed=5)
        tokens = ctx.tokenize(text)

        def run() -> int:
            with lloyal.Branch.create(ctx, 0, params, grammar=grammar) as b:  # type: ignore[arg-type]
                b.prefill(tokens)
                return len(list(b.generate(n)))

    else:
        import llama_cpp

        llm = llama_cpp.Llama(model, n_ctx=512, n_threads=2, n_batch=512, verbose=False)
        g = None
        if engine.endswith("grammar"):
            g = (
                llama_cpp.LlamaGrammar.from_string(gbnf_of(schema), verbose=False)
                if schema in GBNF_FILES
                else llama_cpp.LlamaGrammar.from_json_schema(json.dumps(SCHEMAS[schema]), verbose=False)
            )

        def run() -> int:
            llm.reset()
            res = llm.create_completion(
                text, max_tokens=n, grammar=g, temperature=0.7, top_k=40, top_p=0.95, seed=5
            )
            return int(res["usage"]["completion_tokens"])

    run()  # warm-up (caches, first-use costs)
    t0 = time.perf_counter()
    made = run()
    return {"tokens": made, "seconds": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--worker", nargs=3, metavar=("ENGINE", "PROMPT", "SCHEMA"))
    ap.add_argument("--model", default=None)
    ap.add_argument("--engines", default=",".join(ENGINES), help="a comma-separated subset of ENGINES")
    ap.add_argument("--grammars", default=",".join([*SCHEMAS, *GBNF_FILES]))
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(*a.worker, a.tokens, a.model)))
        return
    import lloyal

    model = a.model or str(lloyal.default_model_path())
    env = {k: v for k, v in os.environ.items() if not k.startswith("GGML_")}
    engines = [e for e in ENGINES if e in a.engines.split(",")]
    names = [g for g in [*SCHEMAS, *GBNF_FILES] if g in a.grammars.split(",")]
    frees = {"llama-cpp-python" if e.startswith("llama") else "lloyal" for e in engines}
    engines = sorted(set(engines) | frees, key=ENGINES.index)  # each ratio needs its free run
    configs = [
        (e, p, s)
        for p in sorted(PROMPTS)
        for s in dict.fromkeys([*names, "issue"])
        for e in engines
        if applies(e, s) and (s in names or e in FREE)
    ]
    rates: dict[tuple[str, str, str], list[float]] = {c: [] for c in configs}
    for _ in range(a.rounds):
        for e, p, s in configs:
            cmd = [sys.executable, __file__, "--worker", e, p, s, "--tokens", str(a.tokens), "--model", model]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            rates[(e, p, s)].append(r["tokens"] / r["seconds"])
    for p in sorted(PROMPTS):
        for s in names:
            for e in engines:
                if not applies(e, s) and e not in FREE:
                    continue
                key = (e, p, s if e not in FREE else "issue")
                base = "llama-cpp-python" if e.startswith("llama") else "lloyal"
                med = statistics.median(rates[key])
                ratio = med / statistics.median(rates[(base, p, "issue")])
                lo, hi = min(rates[key]), max(rates[key])
                print(f"{p:12s} {s:7s} {e:26s} {med:6.1f} tok/s ({lo:.1f}-{hi:.1f})  {ratio:.2f}x")


if __name__ == "__main__":
    main()
