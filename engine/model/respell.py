"""Keyterm respelling's model pass (engine/decoding/respell.py has the rules): a finished window's text
and its alternatives scored teacher-forced by the decoder over the window's own encoder output, while
its cache row still holds it (engine/model/model.py `sequence_logits`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.decoding.respell import RespellSettings, choose, proposals
from engine.decoding.rules import DecodingRules
from engine.model.kv_cache import KVCache
from engine.model.model import Whisper
from engine.scheduling.request import Request


class Respeller:
    """Respells misheard keyterms in finished windows whose cross-attention K/V is still cached."""

    def __init__(
        self, model: Whisper, cache: KVCache, rules: DecodingRules, settings: RespellSettings
    ) -> None:
        self.model = model
        self.cache = cache
        self.rules = rules
        self.settings = settings
        self.positions = int(model.decoder.positional_embedding.shape[0])

    def _decode(self, tokens: list[int]) -> str:
        return str(self.rules.tokenizer.decode(tokens))

    def _encode(self, text: str) -> list[int]:
        return list(self.rules.tokenizer.encode(text, add_special_tokens=False))

    def scores(self, req: Request, sequences: Sequence[Sequence[int]], common: int = 0) -> list[float]:
        """Summed log-probability of each sequence's tokens (end of text included) past its first `common`
        tokens (which all the sequences share, so their part would be the same in every score), after
        req's prompt, over req's audio: one batched decoder pass."""
        eot = self.rules.vocab.eot
        prompt = list(req.prompt_tokens)
        full = [[*prompt, *s] for s in sequences]
        width = max(len(f) for f in full)
        device = self.cache.cross_len.device
        tokens = torch.tensor([f + [eot] * (width - len(f)) for f in full], device=device)
        # Logits only where a scored token is predicted: the output projection is most of the pass.
        first = len(prompt) + common - 1
        assert req.row is not None
        logits = self.model.sequence_logits(tokens, req.row, self.cache, logits_from=first)
        logprobs = logits.float().log_softmax(dim=-1)
        out = []
        for b, f in enumerate(full):
            positions = torch.arange(first + 1, len(f), device=device)
            out.append(float(logprobs[b, positions - 1 - first, tokens[b, positions]].sum()))
        return out

    def respell(self, reqs: Sequence[Request]) -> None:
        """Each request's window tokens (req.generated) with the listed terms the audio agrees with
        spelled in: rounds of proposals and one scoring pass, up to one round per term."""
        eot = self.rules.vocab.eot
        for req in reqs:
            terms = req.options.keyterms
            generated = list(req.generated)
            for _ in range(len(terms)):
                alternatives = [
                    a
                    for a in proposals(generated, terms, self._decode, self._encode, eot, self.settings)
                    if len(req.prompt_tokens) + len(a.tokens) <= self.positions
                ]
                if not alternatives:
                    break
                common = min(a.start for a in alternatives)
                scores = self.scores(req, [generated, *(a.tokens for a in alternatives)], common)
                kept = choose(scores[0], scores[1:], [a.spelled for a in alternatives], self.settings.margin)
                if kept is None:
                    break
                generated = list(alternatives[kept].tokens)
            req.generated = generated
