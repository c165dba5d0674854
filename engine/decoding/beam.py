"""Beam search's choices on the host, as openai/whisper's BeamSearchDecoder makes them (no model here).

A request searching n beams holds n KV-cache rows (engine/scheduling/scheduler.py KVRows); beam b decodes in
request.rows[b]. Each step, every beam proposes its n+1 likeliest next tokens under the decoding rules
(engine/decoding/rules.py beam_candidates); the n likeliest continuations by summed log-probability that do
not end the text become the next beams (their rows take their source rows' self-attention K/V on the
device: engine/model/kv_cache.py reorder), and those that end it are kept as finished, up to n. The search
ends when n have finished, the window's token budget is spent or the row is full; the result is the
best of the finished (topped up with the live beams when fewer than n finished) by summed
log-probability over length (whisper's length_penalty=None rule). Only the request's own logits enter
any choice: a beam search's tokens do not depend on the batch it decodes in.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.scheduling.outcome import repeats_at_end
from engine.scheduling.request import Beam, Request


@dataclass(frozen=True)
class HostTrie:
    """A TermTrie's arrays as Python structures: per node, token -> next node; the roots (0: after a
    boundary, 1: inside a word); the term a node ends (-1: none); the terms through a node, as bits."""

    edges: list[dict[int, int]]
    roots: tuple[dict[int, int], dict[int, int]]
    term: list[int]
    reach: list[int]


@dataclass(frozen=True)
class BeamTerms:
    """One beam's place in its request's trie. `bonus` is in the beam's score; `open_bonus`, the part an
    open match earned, is taken back if the match fails or the text ends inside it."""

    node: int = 0
    open_bonus: float = 0.0
    bonus: float = 0.0
    used: int = 0  # terms kept in this window, as bits

    def boosted(self, trie: HostTrie, boundary: bool) -> dict[int, int]:
        """The tokens that would continue the open match or start one (a term not yet kept in this
        window), each with the node it leads to: a beam search ranks these with the bonus."""
        out = {t: n for t, n in trie.roots[0 if boundary else 1].items() if trie.reach[n] & ~self.used}
        if self.node:
            out.update({t: n for t, n in trie.edges[self.node].items() if trie.reach[n] & ~self.used})
        return out

    def after(self, trie: HostTrie, boundary: bool, token: int, per_token: float) -> BeamTerms:
        """This beam's state after `token` (its score's bonus moved by the difference)."""
        node = 0
        if self.node:
            node = trie.edges[self.node].get(token, 0)
        bonus, open_bonus = self.bonus, self.open_bonus
        if not node or not trie.reach[node] & ~self.used:  # no continuation: the open match failed
            bonus, open_bonus = bonus - open_bonus, 0.0
            node = trie.roots[0 if boundary else 1].get(token, 0)
            if not trie.reach[node] & ~self.used:
                node = 0
        if not node:
            return BeamTerms(0, 0.0, bonus, self.used)
        bonus, open_bonus = bonus + per_token, open_bonus + per_token
        term = trie.term[node]
        if term >= 0 and not self.used >> term & 1:  # a whole term: its bonus is kept
            return BeamTerms(0, 0.0, bonus, self.used | 1 << term)
        return BeamTerms(node, open_bonus, bonus, self.used)

    @property
    def settled(self) -> float:
        """The bonus of a text that ends here: an open match's part taken back."""
        return self.bonus - self.open_bonus


@dataclass(frozen=True)
class TermBias:
    """A request's keyterm bias over its beams: its compiled list, which tokens end at a word boundary
    (engine/decoding/keyterms.py TokenBytes.ends_open) and the bonus per token of a match."""

    trie: HostTrie
    ends_open: np.ndarray  # [n_vocab] bool
    per_token: float

    def boundary(self, beam: Beam) -> bool:
        """Whether a term may start after this beam's last token without a leading space."""
        sampled = len(beam.generated) > beam.request.sample_begin
        return not sampled or bool(self.ends_open[beam.generated[-1]])


def begin(req: Request, bias: TermBias | None = None) -> list[Beam]:
    """The beams of a search's first sampled step: one hypothesis (every row holds the same prompt, so
    n copies would propose the same candidates)."""
    req.beam_finished = {}
    req.beam_bonus = {}
    return [Beam(req, list(req.generated), terms=BeamTerms() if bias is not None else None)]


def advance(
    req: Request,
    beams: list[Beam],
    values: list[list[float]],
    tokens: list[list[int]],
    eot: int,
    bias: TermBias | None = None,
) -> list[int]:
    """The next beams from each beam's candidates (values[i], tokens[i]: log-probabilities and tokens of
    beams[i], likeliest first), ranked by summed log-probability plus the keyterm bonus when `bias` is
    given. Sets req.beams; returns, per new beam, the index in `beams` of the beam it continues (whose
    row's K/V it takes)."""
    size = req.options.beam_size
    logprobs: dict[tuple[int, ...], float] = {}
    scores: dict[tuple[int, ...], float] = {}
    sources: dict[tuple[int, ...], int] = {}
    terms: dict[tuple[int, ...], BeamTerms | None] = {}
    for i, beam in enumerate(beams):
        boundary = bias.boundary(beam) if bias is not None else True
        for logprob, token in zip(values[i], tokens[i], strict=True):
            if logprob == float("-inf"):  # a masked token: fewer allowed tokens than candidates asked
                continue
            sequence = (*beam.generated, token)
            after, bonus = None, 0.0
            if bias is not None and beam.terms is not None:
                if token == eot:  # the text ends: an open match's bonus is taken back
                    bonus = beam.terms.settled
                else:
                    after = beam.terms.after(bias.trie, boundary, token, bias.per_token)
                    bonus = after.bonus
            logprobs[sequence] = beam.sum_logprob + logprob
            scores[sequence] = logprobs[sequence] + bonus
            sources[sequence], terms[sequence] = i, after
    kept: list[Beam] = []
    origin: list[int] = []
    finished: list[tuple[int, ...]] = []
    for sequence in sorted(scores, key=scores.__getitem__, reverse=True):
        if sequence[-1] == eot:
            finished.append(sequence)
        else:
            kept.append(Beam(req, list(sequence), logprobs[sequence], terms=terms[sequence]))
            origin.append(sources[sequence])
            if len(kept) == size:
                break
    for sequence in finished:  # the likeliest first, up to `size` in all
        if len(req.beam_finished) >= size:
            break
        req.beam_finished[sequence] = logprobs[sequence]
        req.beam_bonus[sequence] = scores[sequence] - logprobs[sequence]
    req.beams = kept
    return origin


def over(req: Request, eot: int, max_tokens: int, full_audio_ctx: int) -> bool:
    """Whether the search ends here: enough finished, the token budget spent, the row full, or (trimmed
    windows, as greedy ones: outcome.window_ended) the likeliest beam just said a span twice."""
    if len(req.beam_finished) >= req.options.beam_size or not req.beams:
        return True
    best = req.beams[0]
    if len(best.generated) - req.sample_begin >= req.max_new or req.length + 1 >= max_tokens:
        return True
    return req.audio_ctx < full_audio_ctx and repeats_at_end([t for t in best.generated if t < eot])


def finish(req: Request, eot: int) -> None:
    """The search's result becomes the window's tokens: the best hypothesis by summed log-probability over
    its length in sampled tokens (end of text excluded), as whisper ranks with length_penalty=None; its
    log-probability and sampled tokens count as a greedy window's do."""
    size = req.options.beam_size
    candidates = dict(req.beam_finished)
    bonus = dict(req.beam_bonus)

    def settled(beam: Beam) -> float:
        return beam.terms.settled if beam.terms is not None else 0.0

    for beam in sorted(req.beams, key=lambda b: b.sum_logprob + settled(b), reverse=True):
        if len(candidates) >= size:
            break
        candidates[tuple(beam.generated)] = beam.sum_logprob
        bonus[tuple(beam.generated)] = settled(beam)

    def rank(item: tuple[tuple[int, ...], float]) -> float:
        sequence, score = item
        length = len([t for t in sequence[req.sample_begin :] if t != eot])
        return (score + bonus.get(sequence, 0.0)) / max(1, length)

    best, score = max(candidates.items(), key=rank) if candidates else (tuple(req.generated), 0.0)
    req.generated = list(best)
    req.sum_logprob += score
    req.sampled += len(best) - req.sample_begin
    req.beams = []
    req.beam_finished = {}
    req.beam_bonus = {}
    req.window_done = True
