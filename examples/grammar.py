"""JSON-schema-constrained generation, forked at a choice point into several valid documents.

``lloyal.json_schema_to_grammar(schema)`` turns a JSON Schema (here a product with an enum and a
boolean field) into GBNF; ``Branch.create(ctx, grammar=gbnf)`` makes every sampled token obey
it. The root generates greedily up to the choice point (just before the value of the enum field,
found in the text so far). There it forks ``--children`` children: ``fork`` clones the grammar's
parse state, child i commits the i-th enum value (checked by the grammar like any token) and
``reseed_sampler`` gives each its own RNG. The children complete in lockstep, one
``BranchStore.commit`` per step, each stopping when ``Produced.is_stop`` says its grammar is
complete. Every child's text is checked with ``json.loads`` and against the schema; the children's
perplexities rank the enum values by how natural the model finds them.

Run:
    python examples/grammar.py
    python examples/grammar.py --children 4 --jsonl

Events (``--jsonl``): ``choice_point`` (the shared prefix), one ``child`` per child (text,
valid, perplexity, errors) and a final ``done``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

from _args import example_parser, run

import lloyal

PRODUCT: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "category": {"enum": ["book", "toy", "tool", "food"]},
        "in_stock": {"type": "boolean"},
        "price": {"type": "integer", "minimum": 0, "maximum": 1000},
    },
    "required": ["name", "category", "in_stock", "price"],
    "additionalProperties": False,
}
PROMPT = "A product from the shop catalogue, as JSON:\n"

Event = dict[str, Any]

_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
}


def schema_errors(doc: Any, schema: Mapping[str, Any], path: str = "$") -> list[str]:
    """What makes ``doc`` break ``schema`` (the subset this example uses); empty when it conforms.

    Example:
        >>> schema_errors({"name": "pen", "category": "toy", "in_stock": True, "price": 3}, PRODUCT)
        []
        >>> schema_errors({"name": "pen", "category": "car"}, PRODUCT)[-1]
        "$.category: 'car' is not one of ['book', 'toy', 'tool', 'food']"
    """
    errors: list[str] = []
    kind = schema.get("type")
    if kind is not None:
        is_bool = isinstance(doc, bool)
        if not isinstance(doc, _TYPES[kind]) or (is_bool and kind != "boolean"):
            return [f"{path}: {doc!r} is not of type {kind}"]
    if "enum" in schema and doc not in schema["enum"]:
        errors.append(f"{path}: {doc!r} is not one of {schema['enum']}")
    if "maxLength" in schema and len(doc) > schema["maxLength"]:
        errors.append(f"{path}: longer than {schema['maxLength']}")
    if "minimum" in schema and doc < schema["minimum"]:
        errors.append(f"{path}: below {schema['minimum']}")
    if "maximum" in schema and doc > schema["maximum"]:
        errors.append(f"{path}: above {schema['maximum']}")
    if kind == "object":
        props: Mapping[str, Any] = schema.get("properties", {})
        errors += [f"{path}: missing {key!r}" for key in schema.get("required", []) if key not in doc]
        if schema.get("additionalProperties") is False:
            errors += [f"{path}: unexpected {key!r}" for key in doc if key not in props]
        for key, sub in props.items():
            if key in doc:
                errors += schema_errors(doc[key], sub, f"{path}.{key}")
    return errors


def _check(text: str, schema: Mapping[str, Any]) -> list[str]:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        return [f"not JSON: {exc}"]
    return schema_errors(doc, schema)


def grammar_fork(
    ctx: lloyal.Context,
    prompt: str = PROMPT,
    schema: Mapping[str, Any] = PRODUCT,
    *,
    choice_field: str = "category",
    n_children: int = 3,
    max_prefix: int = 32,
    max_tokens: int = 64,
    seed: int = 1,
) -> Iterator[Event]:
    """Generate ``n_children`` documents matching ``schema`` that share a prefix.

    The root (greedy) stops at the choice point: once the text holds ``"<choice_field>":``, or
    after ``max_prefix`` tokens. When the field is an enum, child i starts with its i-th value
    (cycling); then each child samples up to ``max_tokens`` tokens in all. Needs
    ``n_children + 1`` free leases; every one is given back.

    Example:
        >>> with lloyal.Context(lloyal.default_model_path(), n_ctx=1024, n_seq_max=4) as ctx:
        ...     events = list(grammar_fork(ctx))
        >>> [e["valid"] for e in events if e["event"] == "child"]
        [True, True, True]
    """
    store = lloyal.BranchStore(ctx)
    gbnf = lloyal.json_schema_to_grammar(dict(schema))
    root = lloyal.Branch.create(ctx, 0, lloyal.SamplingParams(temperature=0.0), grammar=gbnf)
    try:
        root.prefill(ctx.tokenize(prompt))
        prefix: list[int] = []
        marker = f'"{choice_field}":'
        for tok in root.generate(max_prefix):
            prefix.append(tok.token)
            if marker in ctx.detokenize(prefix):
                break
        prefix_text = ctx.detokenize(prefix)
        yield {"event": "choice_point", "prefix": prefix_text, "position": root.position}
        hot = lloyal.SamplingParams(temperature=1.0, top_k=40, top_p=0.95, seed=seed)
        children = [root.fork() for _ in range(n_children)]
        for i, child in enumerate(children):
            child.set_sampler_params(hot)
            child.reseed_sampler(seed + 1 + i)
        # At an enum choice point child i starts with the i-th allowed value (committed like any
        # token, so the grammar checks it and the perplexity counts it); then it samples freely.
        values = schema["properties"][choice_field].get("enum", []) if marker in prefix_text else []
        lead = "" if prefix_text[-1:].isspace() else " "
        forced = [
            ctx.tokenize(lead + json.dumps(values[i % len(values)]), add_special=False) if values else []
            for i in range(n_children)
        ]
        out: list[list[int]] = [[] for _ in children]
        live = list(range(n_children))
        for _ in range(max_tokens):
            sampling = [i for i in live if len(out[i]) >= len(forced[i])]
            produced = dict(zip(sampling, store.produce_all([children[i] for i in sampling]), strict=True))
            step = [
                (i, produced[i].token if i in produced else forced[i][len(out[i])])
                for i in live
                if i not in produced or not produced[i].is_stop
            ]
            live = [i for i, _ in step]
            if not step:
                break
            store.commit([(children[i], token) for i, token in step])
            for i, token in step:
                out[i].append(token)
        texts = [prefix_text + ctx.detokenize(o) for o in out]
        valid = 0
        for i, text in enumerate(texts):
            errors = ["did not finish"] if i in live else _check(text, schema)
            valid += not errors
            yield {
                "event": "child",
                "index": i,
                "text": text,
                "valid": not errors,
                "errors": errors,
                "choice": values[i % len(values)] if values else None,
                "tokens": len(out[i]),
                "perplexity": children[i].perplexity,
            }
        yield {"event": "done", "children": n_children, "valid": valid, "distinct": len(set(texts))}
    finally:
        root.prune_subtree()


def main() -> None:
    parser = example_parser(__doc__, prompt=PROMPT, max_tokens=64, max_tokens_help="most tokens per child")
    parser.add_argument("--children", type=int, default=3)
    args = parser.parse_args()
    model = args.model or lloyal.default_model_path()
    with lloyal.Context(model, n_ctx=1024, n_seq_max=args.children + 1) as ctx:
        events = grammar_fork(
            ctx, args.prompt, n_children=args.children, max_tokens=args.max_tokens, seed=args.seed
        )
        for ev in events:
            if args.jsonl:
                print(json.dumps(ev), flush=True)
            elif ev["event"] == "choice_point":
                print(f"schema: {json.dumps(PRODUCT)}\nshared prefix: {ev['prefix']!r}")
            elif ev["event"] == "child":
                verdict = "valid" if ev["valid"] else f"INVALID ({'; '.join(ev['errors'])})"
                print(f"child {ev['index']}: {ev['text']}  [{verdict}, perplexity {ev['perplexity']:.2f}]")
            else:
                print(f"{ev['valid']}/{ev['children']} valid, {ev['distinct']} distinct")


if __name__ == "__main__":
    run(main)
