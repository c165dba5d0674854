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

from engine.scheduling.outcome import repeats_at_end
from engine.scheduling.request import Beam, Request


def begin(req: Request) -> list[Beam]:
    """The beams of a search's first sampled step: one hypothesis (every row holds the same prompt, so
    n copies would propose the same candidates)."""
    req.beam_finished = {}
    return [Beam(req, list(req.generated))]


def advance(
    req: Request, beams: list[Beam], values: list[list[float]], tokens: list[list[int]], eot: int
) -> list[int]:
    """The next beams from each beam's candidates (values[i], tokens[i]: log-probabilities and tokens of
    beams[i], likeliest first). Sets req.beams; returns, per new beam, the index in `beams` of the beam it
    continues (whose row's K/V it takes)."""
    size = req.options.beam_size
    scores: dict[tuple[int, ...], float] = {}
    sources: dict[tuple[int, ...], int] = {}
    for i, beam in enumerate(beams):
        for logprob, token in zip(values[i], tokens[i], strict=True):
            if logprob == float("-inf"):  # a masked token: fewer allowed tokens than candidates asked
                continue
            sequence = (*beam.generated, token)
            scores[sequence] = beam.sum_logprob + logprob
            sources[sequence] = i
    kept: list[Beam] = []
    origin: list[int] = []
    finished: list[tuple[tuple[int, ...], float]] = []
    for sequence in sorted(scores, key=scores.__getitem__, reverse=True):
        if sequence[-1] == eot:
            finished.append((sequence, scores[sequence]))
        else:
            kept.append(Beam(req, list(sequence), scores[sequence]))
            origin.append(sources[sequence])
            if len(kept) == size:
                break
    for sequence, score in finished:  # the likeliest first, up to `size` in all
        if len(req.beam_finished) >= size:
            break
        req.beam_finished[sequence] = score
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
    for beam in sorted(req.beams, key=lambda b: b.sum_logprob, reverse=True):
        if len(candidates) >= size:
            break
        candidates[tuple(beam.generated)] = beam.sum_logprob

    def rank(item: tuple[tuple[int, ...], float]) -> float:
        sequence, score = item
        length = len([t for t in sequence[req.sample_begin :] if t != eot])
        return score / max(1, length)

    best, score = max(candidates.items(), key=rank) if candidates else (tuple(req.generated), 0.0)
    req.generated = list(best)
    req.sum_logprob += score
    req.sampled += len(best) - req.sample_begin
    req.beams = []
    req.beam_finished = {}
    req.window_done = True
