"""Wheel smoke test (wheels.yml, `make smoke-wheel`): the installed wheel imports, tokenizes, and
decodes a few greedy tokens on the model from the `lloyal[model]` extra."""

from __future__ import annotations

import lloyal

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
