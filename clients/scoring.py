"""Word error rate the way Whisper's own evaluations compute it, shared by every benchmark here.

Both sides go through Whisper's English normaliser (transformers' copy of OpenAI's
EnglishTextNormalizer: lower-case, punctuation removed, contractions expanded, spelled
numbers turned into digits), then jiwer scores the whole set at once (corpus WER: total
edits over total reference words), so long and short utterances weigh by their words.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache


@cache
def _normalizer() -> Callable[[str], str]:
    from transformers.models.whisper.english_normalizer import EnglishTextNormalizer

    # The British->American spelling map ships with Hub checkpoints only; our references
    # are written in American spelling, so an empty map changes nothing.
    return EnglishTextNormalizer({})  # type: ignore[no-any-return]


def normalize(text: str) -> str:
    return " ".join(_normalizer()(text).split())


def corpus_wer(references: Sequence[str], hypotheses: Sequence[str]) -> float:
    """WER over a set (0.0 = perfect). Empty hypotheses count as deletions."""
    import jiwer

    if len(references) != len(hypotheses):
        raise ValueError(f"{len(references)} references but {len(hypotheses)} hypotheses")
    refs = [normalize(r) for r in references]
    hyps = [normalize(h) for h in hypotheses]
    keep = [i for i, r in enumerate(refs) if r]  # jiwer refuses empty references
    if not keep:
        return 0.0
    out = jiwer.process_words([refs[i] for i in keep], [hyps[i] for i in keep])
    errors = out.substitutions + out.deletions + out.insertions
    words = out.substitutions + out.deletions + out.hits
    return errors / words if words else 0.0
