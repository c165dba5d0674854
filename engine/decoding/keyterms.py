"""Keyterm boosting in the batched decode step: names and jargon a caller may say.

A list of terms compiles (once per distinct list) into a byte trie of each term's spellings: as
given, with its first letter capitalised and not, each with and without a leading space. A node is a
byte prefix of a spelling, and a token continues a match from node p when p + the token's bytes is
a node: every tokenization of a term matches, not only the tokenizer's own (a model that wants
" Kest" + "oria" where the tokenizer writes " K" + "est" + "oria" is still on the term).

The bias (KeytermBias, the last logit processor), per sequence and step, with lp the rules'
log-probabilities and g the greedy token:

  outside a match  every token that starts a spelling gets `start_bonus`: the likeliest of them wins
                   when its lp is within start_bonus of lp(g), i.e. only when it is near the top
                   already. Spellings without a leading space start only after a word boundary.
  inside a match   the match's evidence is the sum over its tokens of lp(token) - lp(g at that step)
                   (<= 0: how far the model had to be pushed off its own choice). The likeliest token
                   that continues the match and keeps the evidence >= -max_gap is chosen.
  take-back        when no continuation qualifies, the match failed: the sequence goes back to the
                   token where it began, which becomes the greedy token the model chose there, as if
                   the match had never started (its cache row's length is set back; later steps
                   overwrite the K/V past it). A failed partial match costs decode steps, not words;
                   so does a window whose token budget ends inside a match.
  a full match     a node that ends a spelling: the term is kept, and is not boosted again in this
                   window (once said, the model's own copy of it makes a repeat likely enough; boosting
                   it again made tiny.en loop on the name).

End of text and timestamp tokens are never a term's tokens, so never biased. Every step is tensor
operations over the whole batch; a row's state (list, node, evidence, token to go back to, terms kept)
is an input tensor filled from the host (engine/decoding/logits.py RowInputs), and what changed comes back with
the chosen tokens in the rules' one host copy. A row without keyterms keeps its greedy token, and no
row's choice reads another row: a sequence's tokens never depend on its batch company. The
probability recorded for a chosen token (its confidence) is the model's, before the bias.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from engine.decoding.beam import HostTrie, TermBias
from engine.decoding.logits import NEG_INF, RowInputs, StepRows
from engine.parameters import MAX_KEYTERMS

if TYPE_CHECKING:
    from engine.scheduling.request import Request

# Events a step reports per row (bits of kt_event).
STARTED, CONTINUED, ACCEPTED, TOOK_BACK = 1, 2, 4, 8
# A row's terms already kept in this window, as bits in int64 words (enough for MAX_KEYTERMS).
TERM_BITS = 32
TERM_WORDS = -(-MAX_KEYTERMS // TERM_BITS)


@dataclass(frozen=True)
class KeytermSettings:
    """How the engine uses DecodeOptions.keyterms (EngineConfig's keyterm_* flags)."""

    prompt: bool = False  # the terms as Whisper's previous-text prompt
    bias: bool = True  # the trie bias in the decode step
    start_bonus: float = 4.0  # nats: how far below the greedy token a term's first piece may start
    max_gap: float = 12.0  # nats: the evidence a match may spend in all (its first piece included)
    take_back: bool = True  # a failed partial match returns to where it began
    # Compiled lists kept (their arrays' bytes), least recently used dropped: a list of 100 names is
    # ~1 MB, the longest the term bounds allow ~4 MB (docs/operations.md "Limits").
    cache_bytes: int = 64 << 20
    # Without take-back: a plain bonus on the tokens that continue a match (the greedy trie bias).
    continue_bonus: float = 5.0
    # Beam search: nats added to a beam's score per token of an open match, taken back when the match
    # fails (shallow fusion with a refund: a name that starts a token behind survives as a beam).
    beam_bonus: float = 3.5


def spellings(term: str) -> list[str]:
    """The forms of a term the trie holds: as given, first letter capitalised and not; each with a
    leading space (a word inside text) and without (after a boundary)."""
    t = " ".join(term.split())
    forms = dict.fromkeys([t, t[:1].upper() + t[1:], t[:1].lower() + t[1:]])
    return [s for form in forms for s in (" " + form, form)]


class TokenBytes:
    """Each text token's bytes (byte-level BPE undone), and which tokens end at a word boundary."""

    def __init__(self, tokenizer: Any, eot: int, n_vocab: int) -> None:
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
        self.by_bytes: dict[bytes, int] = {}
        self.ends_open = np.ones(n_vocab, dtype=bool)  # special tokens end at a boundary too
        for token_id, piece in enumerate(tokenizer.convert_ids_to_tokens(list(range(eot)))):
            data = bytes(byte_of[c] for c in piece) if all(c in byte_of for c in piece) else b""
            if not data:
                continue
            self.by_bytes.setdefault(data, token_id)
            last = data[-1]
            self.ends_open[token_id] = last < 0x80 and not chr(last).isalnum()
        self.longest = max(len(b) for b in self.by_bytes)


@dataclass(eq=False)
class TermTrie:
    """One keyterm list compiled. Node 0 is outside a match; padding edges lead to node 0."""

    terms: tuple[str, ...]
    edge_token: np.ndarray  # [N, K] int64: tokens that continue a match from node n
    edge_next: np.ndarray  # [N, K] int64: the node each leads to
    term: np.ndarray  # [N] int64: the term a node's spelling ends (-1: none)
    reach: np.ndarray  # [N, TERM_WORDS] int64: the terms whose spellings pass through the node, as bits
    root_token: np.ndarray  # [2, R] int64: first pieces (row 0: after a boundary; 1: inside a word)
    root_next: np.ndarray  # [2, R] int64

    @property
    def nbytes(self) -> int:
        arrays = (self.edge_token, self.edge_next, self.term, self.reach, self.root_token, self.root_next)
        return sum(a.nbytes for a in arrays)

    @functools.cached_property
    def host(self) -> HostTrie:
        """The trie as Python dicts, for a beam search's choices on the host (built on first use)."""
        mask = (1 << TERM_BITS) - 1

        def edges(tokens: np.ndarray, nexts: np.ndarray) -> dict[int, int]:
            return {int(t): int(n) for t, n in zip(tokens, nexts, strict=True) if n > 0}

        return HostTrie(
            [edges(t, n) for t, n in zip(self.edge_token, self.edge_next, strict=True)],
            (edges(self.root_token[0], self.root_next[0]), edges(self.root_token[1], self.root_next[1])),
            self.term.tolist(),
            [sum((int(w) & mask) << (TERM_BITS * i) for i, w in enumerate(row)) for row in self.reach],
        )

    @classmethod
    def compile(cls, terms: Sequence[str], vocab: TokenBytes) -> TermTrie:
        nodes: dict[bytes, int] = {b"": 0}
        edges: list[dict[int, int]] = [{}]
        reach: list[int] = [0]
        ends: dict[int, int] = {}
        roots: tuple[dict[int, int], dict[int, int]] = ({}, {})

        def node(prefix: bytes) -> int:
            if prefix not in nodes:
                nodes[prefix] = len(edges)
                edges.append({})
                reach.append(0)
            return nodes[prefix]

        for index, term in enumerate(terms):
            for spelling in spellings(term):
                word = spelling.encode()
                ends.setdefault(node(word), index)
                for k in range(1, len(word) + 1):
                    reach[node(word[:k])] |= 1 << index
                for j in range(len(word)):
                    for k in range(j + 1, min(len(word), j + vocab.longest) + 1):
                        token = vocab.by_bytes.get(word[j:k])
                        if token is None:
                            continue
                        if not word[:k].strip():
                            continue  # a match begins with a piece that says something, not a bare space
                        if j > 0 and word[:j].strip():
                            edges[node(word[:j])][token] = node(word[:k])
                        elif j == 0:
                            roots[0][token] = node(word[:k])
                            if spelling.startswith(" "):
                                roots[1][token] = node(word[:k])
        width = max(1, max(len(e) for e in edges))
        edge_token = np.zeros((len(edges), width), dtype=np.int64)
        edge_next = np.zeros((len(edges), width), dtype=np.int64)
        for n, e in enumerate(edges):
            edge_token[n, : len(e)], edge_next[n, : len(e)] = list(e), list(e.values())
        root_token = np.zeros((2, max(1, len(roots[0]))), dtype=np.int64)
        root_next = np.zeros_like(root_token)
        for row, r in enumerate(roots):
            root_token[row, : len(r)], root_next[row, : len(r)] = list(r), list(r.values())
        ending = np.full(len(edges), -1, dtype=np.int64)
        ending[list(ends)] = list(ends.values())
        return cls(tuple(terms), edge_token, edge_next, ending, _words(reach), root_token, root_next)


def _words(bits: Sequence[int]) -> np.ndarray:
    """Term sets (Python ints) as TERM_WORDS words of TERM_BITS bits each: [len(bits), TERM_WORDS]."""
    mask = (1 << TERM_BITS) - 1
    return np.array(
        [[(b >> (TERM_BITS * w)) & mask for w in range(TERM_WORDS)] for b in bits], dtype=np.int64
    )


@dataclass(eq=False)
class KeytermState:
    """One sequence's place in its trie in this window (host side; the step reads it as inputs)."""

    trie: TermTrie
    node: int = 0
    evidence: float = 0.0
    boundary: bool = True  # the last token ended at a word boundary (or nothing sampled yet)
    anchor: int | None = None  # index in `generated` where the open match began
    fallback: int = 0  # the greedy token at the anchor: what a take-back chooses
    fallback_logprob: float = 0.0
    match_logprob: float = 0.0  # recorded log-probabilities of the open match's tokens
    found: list[int] = field(default_factory=list)  # terms kept (indices into trie.terms)
    used: np.ndarray = field(default_factory=lambda: _words([0])[0])  # `found` as term bits
    taken_back: int = 0  # matches taken back

    @property
    def found_terms(self) -> list[str]:
        return [self.trie.terms[i] for i in self.found]


@dataclass
class _Stack:
    """The tries of one step's rows stacked for gathers; index 0 is the empty list."""

    tries: list[TermTrie]  # held, so that no id below is reused while this stack is kept
    position: dict[int, int]  # id(trie) -> index
    edge_token: Tensor  # [L, N, K]
    edge_next: Tensor
    term: Tensor  # [L, N]
    reach: Tensor  # [L, N, TERM_WORDS]
    root_token: Tensor  # [L, 2, R]
    root_next: Tensor


def _pad(arrays: list[np.ndarray], fill: int = 0) -> np.ndarray:
    shape = tuple(max(a.shape[d] for a in arrays) for d in range(arrays[0].ndim))
    out = np.full((len(arrays), *shape), fill, dtype=arrays[0].dtype)
    for i, a in enumerate(arrays):
        out[i][tuple(slice(0, s) for s in a.shape)] = a
    return out


class CompiledTries:
    """Compiled keyterm lists, kept within `max_bytes` (least recently used dropped, the newest always
    kept). Any thread: the engine compiles a new list on its compile thread before the request reaches
    the scheduler (a 100-term list takes ~0.3-0.4 s of Python), never on the scheduler's loop, where every
    sequence's decode step would wait for it (engine/core.py `submit`)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._tries: OrderedDict[tuple[str, ...], TermTrie] = OrderedDict()
        self._lock = threading.Lock()
        self.nbytes = 0

    @staticmethod
    def key(terms: Sequence[str]) -> tuple[str, ...]:
        return tuple(dict.fromkeys(" ".join(t.split()) for t in terms))

    def cached(self, terms: Sequence[str]) -> bool:
        with self._lock:
            return self.key(terms) in self._tries

    def get(self, terms: Sequence[str], vocab: TokenBytes) -> TermTrie:
        key = self.key(terms)
        with self._lock:
            trie = self._tries.get(key)
            if trie is not None:
                self._tries.move_to_end(key)
                return trie
        trie = TermTrie.compile(key, vocab)  # outside the lock: other lists are looked up meanwhile
        with self._lock:
            if key not in self._tries:
                self._tries[key] = trie
                self.nbytes += trie.nbytes
            while self.nbytes > self.max_bytes and len(self._tries) > 1:
                _, dropped = self._tries.popitem(last=False)
                self.nbytes -= dropped.nbytes
        return trie

    def __len__(self) -> int:
        return len(self._tries)


@dataclass
class KeytermBias:
    """The keyterm bias as a logit processor (see the module docstring), plus the host-side update of
    each sequence's state from what the step chose (`take`)."""

    tokenizer: Any
    eot: int
    n_vocab: int
    device: torch.device
    settings: KeytermSettings
    _vocab: TokenBytes | None = None
    _vocab_lock: threading.Lock = field(default_factory=threading.Lock)
    _stack: tuple[tuple[TermTrie, ...], _Stack] | None = None

    def __post_init__(self) -> None:
        self.tries = CompiledTries(self.settings.cache_bytes)
        used = tuple(f"used{w}" for w in range(TERM_WORDS))
        self.long_inputs = RowInputs(("list", "node", "inside", "fallback", *used), torch.long, self.device)
        self.float_inputs = RowInputs(("evidence",), torch.float32, self.device)

    @property
    def vocab(self) -> TokenBytes:
        with self._vocab_lock:
            if self._vocab is None:  # built on first use: ~0.1 s over the whole vocabulary
                self._vocab = TokenBytes(self.tokenizer, self.eot, self.n_vocab)
            return self._vocab

    def trie(self, terms: Sequence[str]) -> TermTrie:
        return self.tries.get(terms, self.vocab)

    def needs_compile(self, req: Request) -> bool:
        """Whether `prepare` would compile (a list not yet compiled): the engine then compiles it on its
        compile thread, not on the thread that submits."""
        terms = req.options.keyterms
        return bool(terms) and self.settings.bias and not self.tries.cached(terms)

    def prepare(self, req: Request) -> None:
        """Before the request reaches the scheduler's loop: its list compiled (or found compiled), so that
        its windows start without compiling anything there."""
        terms = req.options.keyterms
        req.keyterm_trie = self.trie(terms) if terms and self.settings.bias else None

    def beam_bias(self, req: Request) -> TermBias | None:
        """The bias of a beam search over its keyterm list (None: no list, or the bias is off)."""
        trie = req.keyterm_trie if self.settings.bias and req.options.keyterms else None
        if trie is None:
            return None
        return TermBias(trie.host, self.vocab.ends_open, self.settings.beam_bonus)

    def start_window(self, req: Request) -> None:
        """A fresh state for a window about to be decoded (None: no bias for this request)."""
        terms = req.options.keyterms
        if not terms or not self.settings.bias:
            req.keyterm = None
            return
        if req.keyterm_trie is None:  # a request that did not come through submit (unit tests)
            req.keyterm_trie = self.trie(terms)
        req.keyterm = KeytermState(req.keyterm_trie)

    def _stacked(self, tries: list[TermTrie]) -> _Stack:
        # keyed by the tries themselves (identity): the key keeps them alive, so no id is reused while
        # the stack built from them is kept (a compiled list may leave the cache meanwhile)
        key = tuple(dict.fromkeys(tries))
        if self._stack is not None and self._stack[0] == key:
            return self._stack[1]
        unique = list({id(t): t for t in tries}.values())
        empty = TermTrie(
            (),
            *(np.zeros((1, 1), np.int64),) * 2,
            np.full(1, -1),
            _words([0]),
            *(np.zeros((2, 1), np.int64),) * 2,
        )
        every = [empty, *unique]

        def stacked(name: str, fill: int = 0) -> Tensor:
            return torch.from_numpy(_pad([getattr(t, name) for t in every], fill)).to(self.device)

        stack = _Stack(
            tries=unique,
            position={id(t): i + 1 for i, t in enumerate(unique)},
            edge_token=stacked("edge_token"),
            edge_next=stacked("edge_next"),
            term=stacked("term", fill=-1),
            reach=stacked("reach"),
            root_token=stacked("root_token"),
            root_next=stacked("root_next"),
        )
        self._stack = (key, stack)
        return stack

    def apply(self, logits: Tensor, rows: StepRows) -> None:
        states = [r.keyterm for r in rows.reqs]
        biased = [i for i, s in enumerate(states) if s is not None]
        if not biased:
            return
        n, s = logits.shape[0], self.settings
        stack = self._stacked([st.trie for st in states if st is not None])
        host_long, host_float = self.long_inputs.host(n), self.float_inputs.host(n)
        for i in biased:
            st = states[i]
            assert st is not None
            host_long[:4, i] = (stack.position[id(st.trie)], st.node, not st.boundary, st.fallback)
            host_long[4:, i] = st.used
            host_float[0, i] = st.evidence
        inputs = self.long_inputs.upload(n)
        lists, node, inside, fallback, used = inputs[0], inputs[1], inputs[2], inputs[3], inputs[4:].T
        evidence = self.float_inputs.upload(n)[0]

        def open_terms(nodes: Tensor) -> Tensor:
            """[B, C] nodes -> whether a term not yet kept in this window passes through each."""
            return ((stack.reach[lists[:, None], nodes] & ~used[:, None, :]) != 0).any(dim=-1)

        logprobs = rows.logprobs(logits)  # the rules' distribution, before this bias
        greedy_logit, greedy = logits.max(dim=-1, keepdim=True)  # the first maximum, as argmax
        greedy_lp = logprobs.gather(1, greedy)
        in_match = (node > 0)[:, None]
        # Starts: the likeliest first piece wins with the bonus (one within max_gap of the greedy token).
        start_token, start_next = stack.root_token[lists, inside], stack.root_next[lists, inside]
        start_lp = logprobs.gather(1, start_token)
        start_ok = (
            (start_next > 0) & ~in_match & (start_lp - greedy_lp >= -s.max_gap) & open_terms(start_next)
        )
        start_score = torch.where(start_ok, logits.gather(1, start_token) + s.start_bonus, NEG_INF)
        best_start, start_at = start_score.max(dim=-1, keepdim=True)
        # Continuations: the likeliest one that keeps the match's evidence within max_gap.
        cont_token, cont_next = stack.edge_token[lists, node], stack.edge_next[lists, node]
        cont_lp = logprobs.gather(1, cont_token)
        cont_ok = (cont_next > 0) & in_match & open_terms(cont_next)
        if s.take_back:
            cont_ok &= evidence[:, None] + cont_lp - greedy_lp >= -s.max_gap
        cont_score = torch.where(cont_ok, logits.gather(1, cont_token), NEG_INF)
        best_cont, cont_at = cont_score.max(dim=-1, keepdim=True)
        if s.take_back:
            continued = cont_ok.any(dim=-1, keepdim=True)
            took_back = in_match & ~continued
        else:  # the plain greedy trie bias: a bonus on continuations, and a failed match stays
            continued = best_cont + s.continue_bonus > greedy_logit
            took_back = torch.zeros_like(continued)
        started = ~in_match & (best_start > greedy_logit)
        token = torch.where(
            continued,
            cont_token.gather(1, cont_at),
            torch.where(
                took_back, fallback[:, None], torch.where(started, start_token.gather(1, start_at), greedy)
            ),
        )
        # The choice, made certain in the logits too (rows without keyterms: their greedy token).
        logits.scatter_(1, token, float("inf"))
        rows.tokens = token[:, 0]

        reached = torch.where(
            continued, cont_next.gather(1, cont_at), torch.where(started, start_next.gather(1, start_at), 0)
        )[:, 0]
        gap = (torch.where(continued, cont_lp.gather(1, cont_at), start_lp.gather(1, start_at)) - greedy_lp)[
            :, 0
        ]
        continued, started, took_back = continued[:, 0], started[:, 0], took_back[:, 0]
        evidence = torch.where(continued, evidence + gap, torch.where(started, gap, 0.0))
        term = stack.term[lists, reached]
        term_used = (
            used.gather(1, (term.clamp(min=0) // TERM_BITS)[:, None])[:, 0] >> (term.clamp(min=0) % TERM_BITS)
        ) & 1
        accepted = (reached > 0) & (term >= 0) & (term_used == 0)
        rows.fetch["kt_event"] = (
            started * STARTED + continued * CONTINUED + accepted * ACCEPTED + took_back * TOOK_BACK
        )
        rows.fetch["kt_node"] = reached  # the node this token reached (a full match's ends it)
        rows.fetch["kt_evidence"] = evidence
        rows.fetch["kt_greedy"] = greedy[:, 0]
        rows.fetch["kt_greedy_lp"] = greedy_lp[:, 0]

    def take(self, req: Request, token: int, logprob: float, fetched: dict[str, float] | None) -> None:
        """Append the step's choice to `req` and move its keyterm state on; a take-back first returns
        the sequence to where its match began."""
        st = req.keyterm
        if st is None or fetched is None:
            _append(req, token, logprob)
            return
        event, reached = int(fetched["kt_event"]), int(fetched["kt_node"])
        node = 0 if event & ACCEPTED else reached
        # A window whose budget ends inside a match takes it back too: no partial term in the text.
        budget_ends = node > 0 and req.window_sampled + 1 >= req.max_new
        if event & TOOK_BACK or (budget_ends and self.settings.take_back):
            if st.anchor is None:  # the match would have begun with this very token
                _append(req, int(fetched["kt_greedy"]), fetched["kt_greedy_lp"])
                st.node, st.evidence = 0, 0.0
            else:
                self._take_back(req, st)
        else:
            _append(req, token, logprob)
            if event & STARTED:
                st.anchor = len(req.generated) - 1
                st.fallback, st.fallback_logprob = int(fetched["kt_greedy"]), fetched["kt_greedy_lp"]
                st.match_logprob = logprob
            elif event & CONTINUED:
                st.match_logprob += logprob
            if event & ACCEPTED:
                st.found.append(int(st.trie.term[reached]))
                st.used = _words([sum(1 << t for t in st.found)])[0]
            if node == 0:
                st.anchor = None
            st.node, st.evidence = node, fetched["kt_evidence"] if node else 0.0
        st.boundary = bool(self.vocab.ends_open[req.generated[-1]])

    def _take_back(self, req: Request, st: KeytermState) -> None:
        """Back to the token where the open match began, which becomes the greedy one of that step.
        Called before this step's token is appended: every token from the anchor on is in the cache."""
        assert st.anchor is not None
        removed = len(req.generated) - st.anchor
        del req.generated[st.anchor :]
        req.length -= removed  # the row's cache past here is stale: masked, then overwritten
        req.sampled -= removed
        req.sum_logprob -= st.match_logprob
        _append(req, st.fallback, st.fallback_logprob)
        st.node, st.evidence, st.anchor = 0, 0.0, None
        st.taken_back += 1


def _append(req: Request, token: int, logprob: float) -> None:
    req.generated.append(token)
    req.sum_logprob += logprob
    req.sampled += 1
