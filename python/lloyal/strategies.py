"""Decoding strategies on branches: best-of-N, beam search and prompt-lookup speculative decoding.

Built only on the public API (``Branch``, ``BranchStore``, ``Context``): each function is a
worked example of forking, lockstep commits and ``retain_only`` as much as a utility.

Example:
    >>> import lloyal
    >>> from lloyal import strategies
    >>> with lloyal.create_context(n_ctx=512, n_seq_max=4) as ctx:
    ...     best = strategies.best_of_n(ctx, "The sea was", n=3, max_tokens=4, seed=7)
    ...     len(best.texts), best.perplexities[best.index] == min(best.perplexities)
    (3, True)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from lloyal._lloyal import Branch, BranchStore, Context
from lloyal.sampling import SamplingParams

__all__ = [
    "BeamResult",
    "BestOfN",
    "DraftFn",
    "SpecResult",
    "beam_search",
    "best_of_n",
    "prompt_lookup_drafts",
    "speculative_generate",
]

#: A draft proposer: ``(history, k) -> up to k tokens`` guessed to come next.
DraftFn = Callable[[Sequence[int], int], list[int]]

_GREEDY = SamplingParams(temperature=0)


def _prompt_tokens(ctx: Context, prompt: str | Sequence[int]) -> list[int]:
    # "" is no text (its tokens would be the BOS alone)
    tokens = (ctx.tokenize(prompt) if prompt else []) if isinstance(prompt, str) else list(prompt)
    if not tokens:
        raise ValueError("the prompt is empty: give at least one token to condition on")
    return tokens


def _need_leases(ctx: Context, store: BranchStore, needed: int, what: str) -> None:
    if ctx.n_seq_max < needed:
        raise ValueError(
            f"{what} needs {needed} branch leases but the context has n_seq_max={ctx.n_seq_max}: "
            f"create it with n_seq_max>={needed}"
        )
    if store.available < needed:
        raise ValueError(
            f"{what} needs {needed} free branch leases but only {store.available} of "
            f"n_seq_max={ctx.n_seq_max} are free: prune the branches you no longer need"
        )


# ---------------------------------------------------------------------------------------------
# Best-of-N


@dataclass(frozen=True)
class BestOfN:
    """The outcome of :func:`best_of_n`.

    Attributes:
        branch: The winning branch, now a root holding the only lease :func:`best_of_n` kept
            (positioned after the prompt and its continuation; continue it or prune it).
        index: Which candidate won (index into the tuples below).
        texts: Every candidate's continuation text, in candidate order.
        tokens: Every candidate's continuation tokens (stop token excluded).
        perplexities: Every candidate's model perplexity (``inf`` for an empty one).
        stopped: Whether each candidate ended on a stop token (else it reached ``max_tokens``).
        steps: Lockstep steps, each ONE ``BranchStore.commit`` (one decode) of every live
            candidate.
    """

    branch: Branch
    index: int
    texts: tuple[str, ...]
    tokens: tuple[tuple[int, ...], ...]
    perplexities: tuple[float, ...]
    stopped: tuple[bool, ...]
    steps: int

    @property
    def text(self) -> str:
        """The winner's continuation text."""
        return self.texts[self.index]


def best_of_n(
    ctx: Context,
    prompt: str | Sequence[int],
    n: int,
    params: SamplingParams | None = None,
    max_tokens: int = 64,
    *,
    seed: int = 1,
    on_step: Callable[[int], None] | None = None,
) -> BestOfN:
    """Sample ``n`` continuations of ``prompt`` in lockstep and keep the least perplexing one.

    The prompt is prefilled once; ``n`` branches share its KV cells (the root is candidate 0,
    the others are forks), each with its sampler reseeded to ``seed + 1 + i``. Every step
    samples all live candidates with one ``produce_all`` and decodes them with ONE
    ``BranchStore.commit``; a candidate stops at its first stop token (not committed) or after
    ``max_tokens``. The winner is the lowest model perplexity; ``BranchStore.retain_only``
    keeps its sequence, so every other branch of ``ctx`` is disposed (including any the
    caller holds) and ``n_seq_max - 1`` leases are free afterwards.

    Args:
        ctx: The context; it needs ``n`` free leases.
        prompt: Text (tokenized with BOS) or token ids.
        n: Number of candidates (>= 1).
        params: Sampling parameters (default temperature 0.8, top-k 40, top-p 0.95). Their
            ``seed`` is replaced by the per-candidate seeds.
        max_tokens: Most tokens per candidate.
        seed: Base seed; equal seeds give equal results.
        on_step: Called after each lockstep decode with the number of candidates still live
            (the CLI draws its progress bar with it).

    Returns:
        The winner branch and every candidate's text, tokens, perplexity and end.

    Raises:
        ValueError: ``n < 1``, ``max_tokens < 0``, an empty prompt, or too few leases.

    Example:
        >>> from lloyal import create_context
        >>> with create_context(n_ctx=512, n_seq_max=4) as ctx:
        ...     best = best_of_n(ctx, "Once upon a time", n=4, max_tokens=8)
        ...     len(best.tokens), best.perplexities[best.index] == min(best.perplexities)
        (4, True)
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    store = BranchStore(ctx)
    _need_leases(ctx, store, n, "best_of_n")
    tokens_in = _prompt_tokens(ctx, prompt)
    if params is None:
        params = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=seed)
    root = Branch.create(ctx, 0, params)
    try:
        root.prefill(tokens_in)
        branches = [root, *(root.fork() for _ in range(n - 1))]
    except BaseException:
        root.prune_subtree()
        raise
    out: list[list[int]] = [[] for _ in branches]
    stopped = [False] * n
    live = list(range(n))
    steps = 0
    try:  # an error or an interrupt gives back every candidate's lease and cells
        for i, b in enumerate(branches):
            b.reseed_sampler(seed + 1 + i)
        while live and steps < max_tokens:
            produced = store.produce_all([branches[i] for i in live])
            step = []
            for i, p in zip(live, produced, strict=True):
                if p.is_stop:
                    stopped[i] = True
                else:
                    step.append((i, p.token))
            live = [i for i, _ in step]
            if not step:
                break
            store.commit([(branches[i], t) for i, t in step])
            for i, t in step:
                out[i].append(t)
            steps += 1
            if on_step is not None:
                on_step(len(live))
    except BaseException:
        root.prune_subtree()
        raise
    perplexities = tuple(b.perplexity for b in branches)
    winner = min(range(n), key=lambda i: perplexities[i])
    store.retain_only(branches[winner])
    return BestOfN(
        branch=branches[winner],
        index=winner,
        texts=tuple(ctx.detokenize(t) for t in out),
        tokens=tuple(tuple(t) for t in out),
        perplexities=perplexities,
        stopped=tuple(stopped),
        steps=steps,
    )


# ---------------------------------------------------------------------------------------------
# Beam search


@dataclass(frozen=True)
class BeamResult:
    """The outcome of :func:`beam_search`.

    Attributes:
        branch: The best hypothesis's branch, now the context's only branch (a root holding
            one lease), positioned right after its last token (a final stop token is not
            written).
        tokens: The hypothesis's tokens (stop token excluded).
        text: Their text.
        score: Sum of the tokens' log-probabilities (nats, <= 0), a finished hypothesis's
            stop token's included (as Hugging Face's beam search scores it).
        perplexity: ``exp(-score / len(tokens))``, as ``Branch.perplexity`` defines it
            (``inf`` when no token was generated). Over every token: after a compaction the
            branch's own ``perplexity`` and penalty history count only the tokens committed
            since (a rebuilt beam's earlier tokens are prefilled, as a prompt is).
        finished: Whether the hypothesis ended on a stop token (else it hit ``max_tokens``).
        compactions: How often the beams were rebuilt from the prompt to free leases.
    """

    branch: Branch
    tokens: tuple[int, ...]
    text: str
    score: float
    perplexity: float
    finished: bool
    compactions: int = 0


@dataclass
class _Beam:
    branch: Branch
    tokens: list[int]
    score: float


def _log_softmax(logits: npt.NDArray[np.float32]) -> npt.NDArray[np.float64]:
    x = logits.astype(np.float64)
    top = float(np.max(x))
    if not math.isfinite(top):
        raise ValueError("the branch's logits have no finite entry (every token banned?)")
    x -= top
    return x - math.log(float(np.sum(np.exp(x))))


def _top(logp: npt.NDArray[np.float64], k: int) -> list[int]:
    idx = np.argpartition(-logp, k - 1)[:k] if k < logp.size else np.arange(logp.size)
    # Highest first; equal scores by lowest token id, as greedy argmax does.
    return sorted((int(i) for i in idx), key=lambda i: (-logp[i], i))


def _perplexity(score: float, n: int) -> float:
    return math.exp(-score / n) if n else math.inf


def beam_search(
    ctx: Context,
    prompt: str | Sequence[int],
    width: int,
    max_tokens: int,
) -> BeamResult:
    """Beam search of width ``width`` on forked branches; the best hypothesis is retained.

    Each step takes every live beam's ``width`` most likely next tokens from
    ``Branch.logits`` (log-softmax), scores the extensions by cumulative log-probability and
    keeps the best ``width``. A beam kept with several extensions is forked (its KV prefix
    is shared, not copied), a beam kept with none is pruned, and all kept beams advance with
    ONE ``BranchStore.commit``. An extension by a stop token becomes a finished hypothesis
    (it holds no slot). When the fork tree leaves no free lease (a dropped beam whose forks
    live on must stay until they die), the kept beams are rebuilt as fresh forks of the
    prompt with one packed ``BranchStore.prefill``. At the end the hypothesis with the
    lowest perplexity (finished or not) wins and ``retain_only`` keeps it: every other
    branch of ``ctx``, including any the caller holds, is disposed.

    Width 1 is greedy decoding: the same tokens as ``temperature=0`` sampling.

    Args:
        ctx: The context; it needs ``width + 1`` free leases (the prompt branch + the beams).
        prompt: Text (tokenized with BOS) or token ids.
        width: Beam width K (>= 1).
        max_tokens: Most tokens per hypothesis (>= 1).

    Returns:
        The winner's branch, tokens, text, score and perplexity.

    Raises:
        ValueError: Bad ``width``/``max_tokens``, an empty prompt, or fewer than
            ``width + 1`` leases (``n_seq_max`` or free ones).

    Example:
        >>> from lloyal import create_context
        >>> with create_context(n_ctx=512, n_seq_max=4) as ctx:
        ...     result = beam_search(ctx, "The capital of France is", width=3, max_tokens=4)
        ...     len(result.tokens) <= 4, result.score <= 0, result.branch.parent is None
        (True, True, True)
    """
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    store = BranchStore(ctx)
    _need_leases(ctx, store, width + 1, f"beam_search(width={width})")
    tokens_in = _prompt_tokens(ctx, prompt)
    root = Branch.create(ctx, 0, _GREEDY)
    try:
        root.prefill(tokens_in)
        beams = [_Beam(root.fork(), [], 0.0)]
        finished: list[tuple[list[int], float]] = []
        compactions = 0
        for _ in range(max_tokens):
            candidates: list[tuple[float, int, int]] = []  # (score, beam index, token)
            for bi, beam in enumerate(beams):
                logp = _log_softmax(beam.branch.logits)
                candidates += [(beam.score + float(logp[t]), bi, t) for t in _top(logp, width)]
            candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
            kept: list[tuple[float, int, int]] = []
            for cand in candidates:
                if len(kept) == width:
                    break
                if ctx.is_stop_token(cand[2]):  # scored with its stop token's log-probability
                    finished.append((list(beams[cand[1]].tokens), cand[0]))
                else:
                    kept.append(cand)
            if not kept:
                beams = []
                break
            beams, compacted = _advance(ctx, store, root, beams, kept)
            compactions += compacted
        return _finish(ctx, store, root, beams, finished, compactions)
    except BaseException:
        if not root.disposed:
            root.prune_subtree()
        raise


def _advance(
    ctx: Context,
    store: BranchStore,
    root: Branch,
    beams: list[_Beam],
    kept: list[tuple[float, int, int]],
) -> tuple[list[_Beam], int]:
    """Fork, prune and commit so that ``kept`` ``(score, beam, token)`` become the beams."""
    children: dict[int, list[tuple[float, int]]] = {}
    for score, bi, token in kept:
        children.setdefault(bi, []).append((score, token))
    keep_handles = {beams[bi].branch.handle for bi in children} | {root.handle}
    for bi, beam in enumerate(beams):
        if bi not in children:
            _prune_upwards(beam.branch, keep_handles)
    compacted = 0
    if store.available < len(kept) - len(children):
        # Dropped beams with live forks still hold leases: rebuild the parents from the prompt.
        parents = sorted(children)
        rebuilt = _rebuild(store, root, [beams[bi] for bi in parents])
        beams = [beams[bi] if bi not in children else rebuilt[parents.index(bi)] for bi in range(len(beams))]
        compacted = 1
    new: list[_Beam] = []
    pairs: list[tuple[Branch, int]] = []
    for bi, exts in children.items():
        parent = beams[bi]
        for j, (score, token) in enumerate(exts):
            branch = parent.branch if j == len(exts) - 1 else parent.branch.fork()
            new.append(_Beam(branch, [*parent.tokens, token], score))
            pairs.append((branch, token))
    store.commit(pairs)
    return new, compacted


def _prune_upwards(branch: Branch, keep: set[int]) -> None:
    """Prune a dropped beam if it is a leaf, then every ancestor left a childless non-beam."""
    node: Branch | None = branch
    # (a node pruned already, as the ancestor of an earlier dropped beam, is passed over)
    while node is not None and not node.disposed and node.handle not in keep and node.is_leaf:
        parent = node.parent
        node.prune()
        node = parent


def _rebuild(store: BranchStore, root: Branch, parents: list[_Beam]) -> list[_Beam]:
    """Replace the whole beam tree by one fresh fork of ``root`` per parent (packed prefill)."""
    for child in root.children:
        child.prune_subtree()
    fresh = [_Beam(root.fork(), list(p.tokens), p.score) for p in parents]
    store.prefill([(b.branch, b.tokens) for b in fresh if b.tokens])
    return fresh


def _finish(
    ctx: Context,
    store: BranchStore,
    root: Branch,
    beams: list[_Beam],
    finished: list[tuple[list[int], float]],
    compactions: int,
) -> BeamResult:
    """Pick the lowest-perplexity hypothesis, give it a branch and ``retain_only`` it."""
    pool: list[tuple[float, int, list[int], float, Branch | None]] = [
        (_perplexity(s, len(t)), i, t, s, None) for i, (t, s) in enumerate(finished)
    ]
    pool += [
        (_perplexity(b.score, len(b.tokens)), len(finished) + i, b.tokens, b.score, b.branch)
        for i, b in enumerate(beams)
    ]
    ppl, _, tokens, score, branch = min(pool, key=lambda h: (h[0], h[1]))
    done = branch is None
    if branch is None:  # a finished hypothesis: its beam moved on, so write it afresh
        for child in root.children:
            child.prune_subtree()
        branch = root.fork()
        if tokens:
            branch.prefill(tokens)
    store.retain_only(branch)
    return BeamResult(
        branch=branch,
        tokens=tuple(tokens),
        text=ctx.detokenize(tokens),
        score=score,
        perplexity=ppl,
        finished=done,
        compactions=compactions,
    )


# ---------------------------------------------------------------------------------------------
# Speculative decoding


@dataclass(frozen=True)
class SpecResult:
    """The outcome of :func:`speculative_generate`.

    Attributes:
        branch: The branch that generated (created by the call when given a context: prune
            it, or use it as a context manager, when done).
        tokens: The generated tokens (up to the first stop token, excluded).
        text: Their text.
        rounds: ``Branch.verify`` calls.
        decodes: ``llama_decode`` calls (a round with drafts takes two: drafts, then bonus).
        drafted: Draft tokens proposed.
        accepted: Draft tokens the sampler agreed with.
        stopped: Whether a stop token ended generation (it was committed by ``verify``).
    """

    branch: Branch
    tokens: tuple[int, ...]
    text: str
    rounds: int
    decodes: int
    drafted: int
    accepted: int
    stopped: bool

    @property
    def acceptance(self) -> float:
        """``accepted / drafted`` (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0


def prompt_lookup_drafts(history: Sequence[int], k: int, ngram: int = 2) -> list[int]:
    """The up-to-``k`` tokens that followed the latest earlier occurrence of the last ``ngram``.

    Example:
        >>> prompt_lookup_drafts([1, 2, 3, 9, 1, 2], 2)
        [3, 9]
        >>> prompt_lookup_drafts([1, 2, 3], 4)
        []
    """
    if k <= 0 or len(history) <= ngram:
        return []
    seq = list(history)
    tail = seq[-ngram:]
    for start in range(len(seq) - ngram - 1, -1, -1):
        if seq[start : start + ngram] == tail:
            return seq[start + ngram : start + ngram + k]
    return []


def speculative_generate(
    target: Context | Branch,
    prompt: str | Sequence[int],
    max_tokens: int = 64,
    *,
    draft: DraftFn | None = None,
    k: int = 8,
    params: SamplingParams | None = None,
    history: Sequence[int] = (),
) -> SpecResult:
    """Generate with drafted tokens verified in one decode each round (``Branch.verify``).

    Each round asks ``draft(history, n)`` for up to ``n = min(k, tokens left - 1)`` guesses
    (default: :func:`prompt_lookup_drafts`, which copies what followed the last bigram's
    previous occurrence); ``verify`` decodes them in one batch, keeps the prefix the
    branch's own sampler agrees with and commits the sampler's next token. With greedy
    sampling the output equals plain greedy decoding token for token (on a batch-invariant
    context: see ``Branch.verify``); with a seeded sampler it is a valid sample of the same
    distribution.

    Args:
        target: A context (a branch is created with ``params`` and the prompt prefilled;
            it needs one free lease) or a branch to continue (the prompt is prefilled onto it
            if not empty; it must have logits then).
        prompt: Text (tokenized with BOS) or token ids; also the start of the draft history.
        max_tokens: Most tokens to generate.
        draft: The draft proposer ``(history, n) -> tokens`` (at most ``n`` are used).
        k: Most drafts per round (below the context's ``n_batch``).
        params: Sampling parameters for a created branch (default greedy).
        history: Tokens already in ``target``'s sequence, before ``prompt``, for the drafts.

    Returns:
        The branch, the generated tokens and the draft statistics.

    Example:
        >>> from lloyal import create_context
        >>> with create_context(n_ctx=512) as ctx:
        ...     r = speculative_generate(ctx, "Copy: a b c d. Copy: a b c d. Copy: a b", 8)
        ...     r.decodes < len(r.tokens) + 1 and r.accepted <= r.drafted
        True
    """
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    propose = draft if draft is not None else prompt_lookup_drafts
    if isinstance(target, Context):
        ctx = target
        tokens_in = _prompt_tokens(ctx, prompt)
        branch = Branch.create(ctx, 0, params if params is not None else _GREEDY)
        try:
            branch.prefill(tokens_in)
        except BaseException:
            branch.prune()
            raise
    else:
        branch = target
        ctx = branch.context
        # text goes on from where the branch is: a BOS only at its start ("" is no tokens)
        if isinstance(prompt, str):
            tokens_in = ctx.tokenize(prompt, add_special=branch.position == 0) if prompt else []
        else:
            tokens_in = list(prompt)
        if tokens_in:
            branch.prefill(tokens_in)
    seen = [*history, *tokens_in]
    out: list[int] = []
    rounds = decodes = drafted = accepted = 0
    stopped = False
    store = BranchStore(ctx)
    try:
        while len(out) < max_tokens and not stopped:
            # a round takes its drafts and one more token: within what is left, and within the
            # KV cells left (the tokens so far are returned when the cache is full)
            room = store.kv_pressure.remaining
            if room < 1:
                break
            n = max(0, min(k, max_tokens - len(out) - 1, room - 1))
            drafts = list(propose(seen, n))[:n]
            n = branch.verify(drafts)
            rounds += 1
            decodes += 2 if drafts else 1
            drafted += len(drafts)
            accepted += n
            bonus = branch.last_token
            assert bonus is not None  # verify always commits one token
            new = [*drafts[:n], bonus]
            seen += new
            for t in new:
                if ctx.is_stop_token(t):
                    stopped = True
                    break
                out.append(t)
    except BaseException:
        if branch is not target:  # the branch made here goes with its lease; a caller's stays
            branch.prune()
        raise
    return SpecResult(
        branch=branch,
        tokens=tuple(out),
        text=ctx.detokenize(out),
        rounds=rounds,
        decodes=decodes,
        drafted=drafted,
        accepted=accepted,
        stopped=stopped,
    )
