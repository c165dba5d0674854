"""service/redaction.py as pure functions: spoken and written numbers, cards, SSNs, near-misses, and the
hold-back policy for a card split across two finals. End-to-end (spoken audio through a real server) is in
tests/test_service_redaction.py."""

from __future__ import annotations

import re

import pytest

from service.redaction import (
    HOLD_AUDIO_S,
    Kind,
    StreamRedactor,
    Word,
    redact_text,
    redact_utterances,
    redact_words,
    words_of_text,
)

PCI = frozenset({Kind.PCI})
SSN = frozenset({Kind.SSN})
NUMBERS = frozenset({Kind.NUMBERS})
ALL = frozenset(Kind)
VISA = "4111 1111 1111 1111"  # passes Luhn
ORDER = "4111 1111 1111 1112"  # 16 digits, fails Luhn


@pytest.mark.parametrize(
    "text",
    [
        f"My card number is {VISA}.",
        "My card number is 4111111111111111.",
        "My card number is 4111-1111-1111-1111.",
        "It's four one one one, one one one one, one one one one, one one one one.",
        "four one one one one one one one one one one one one one one one",
        "five five five five, double five five five, four four four four, four four four four",
        "3782 822463 10005 is my Amex.",  # 15 digits, grouped 4-6-5
        "Card 4 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 thanks",
        "It's forty one eleven, eleven eleven, eleven eleven, eleven eleven.",
        "six oh one one zero zero zero nine nine zero one three nine four two four",  # Discover, with "oh"
        "My card number is for five three two zero one five one one two eight three zero three six six",
        "My card number is 4916. Free 385, 0608, 2832.",  # tiny.en's "free" for three
    ],
)
def test_card_numbers_become_one_pci_word(text: str) -> None:
    out = redact_text(text, PCI)
    assert "[PCI]" in out
    assert not re.search(r"\d", out), out
    assert not re.search(r"\b(one|four|five|eleven|six|zero|nine)\b", out.lower()), out


def test_security_code_and_expiry_after_the_card_are_pci() -> None:
    out = redact_text(f"Card {VISA}, it expires 04/27 and the code on the back is 737. Thank you.", PCI)
    assert out == "Card [PCI], it expires [PCI] and the code on the back is [PCI]. Thank you."
    spoken = redact_text(f"{VISA}. Expiry oh four, twenty seven. Security code seven three seven.", PCI)
    assert spoken == "[PCI]. Expiry [PCI]. Security code [PCI]."


@pytest.mark.parametrize(
    "text",
    [
        f"Your order number is {ORDER}.",  # 16 digits failing Luhn
        "Call me back at 555-123-4567 please.",  # a phone number
        "Call me back at five five five, one two three, four five six seven.",
        "The technician comes at 10:30 or at 4:15 on the 12th.",  # times of day
        "I have one question about two invoices.",
        "Oh, I see, one moment.",
        "Thanks for 2 items, to 3 people.",
    ],
)
def test_near_misses_are_not_cards(text: str) -> None:
    assert redact_text(text, PCI | SSN) == text


def test_a_card_number_with_numbers_on_is_pci_and_the_rest_number() -> None:
    out = redact_text(f"Card {VISA}, call me at 555-123-4567 at 10:30.", ALL)
    assert out == "Card [PCI], call me at [NUMBER] at [NUMBER]."


@pytest.mark.parametrize(
    "text",
    [
        "My social security number is 123-45-6789.",
        "My SSN is 123 45 6789.",
        "Social security: one two three four five six seven eight nine.",
        "My social is 123456789.",
        "It is 536-90-4399.",  # written 3-2-4: an SSN without context
    ],
)
def test_social_security_numbers(text: str) -> None:
    out = redact_text(text, SSN)
    assert "[SSN]" in out and not re.search(r"\d", out), out


@pytest.mark.parametrize(
    "text",
    [
        "Your order number is 123456789.",  # nine digits without context
        "My social security number is 000-12-3456.",  # not a valid SSN (area 000)
        "My social security number is 219-09-9999.",  # a published, never-issued example number
        "My social security number ends in 6789.",  # four digits
        "My phone is 555-123-4567, not my social.",
    ],
)
def test_ssn_near_misses(text: str) -> None:
    assert "[SSN]" not in redact_text(text, SSN)


def test_numbers_redacts_every_run_of_digits() -> None:
    assert redact_text("Order 12, room forty one, ext. 5 and one moment.", NUMBERS) == (
        "Order [NUMBER], room [NUMBER], ext. [NUMBER] and one moment."
    )


def test_a_redacted_span_is_one_word_with_the_span_times() -> None:
    words = [
        Word(" card", 0.0, 0.4, 0.9),
        *(Word(f" {g}", 0.5 + i, 1.3 + i, 0.8) for i, g in enumerate(VISA.split())),
        Word(" thanks.", 5.0, 5.4, 0.7),
    ]
    out = redact_words(words, PCI)
    assert [w.text for w in out] == [" card", " [PCI]", " thanks."]
    assert (out[1].start_s, out[1].end_s) == (0.5, 4.3)
    assert out[1].probability == pytest.approx(0.8)


def test_a_card_split_across_two_utterances_is_redacted_in_both() -> None:
    first, second = redact_utterances(
        [words_of_text("My card is 4111 1111"), words_of_text("1111 1111, thanks.")], PCI
    )
    assert "".join(w.text for w in first) == "My card is [PCI]"
    assert "".join(w.text for w in second) == "[PCI], thanks."


def test_stream_holds_a_final_ending_in_digits_until_the_next() -> None:
    r: StreamRedactor[str] = StreamRedactor(PCI)
    assert r.final(words_of_text("Hello, my card is 4111 1111"), "a", end_s=3.0) == []
    # An interim ending in digits is masked at once: it may be the rest of the held card.
    assert "".join(w.text for w in r.interim(words_of_text("1111 11"))) == "[PCI]"
    out = r.final(words_of_text("1111 1111."), "b", end_s=6.0)
    assert [(p, "".join(w.text for w in ws)) for p, ws in out] == [
        ("a", "Hello, my card is [PCI]"),
        ("b", "[PCI]."),
    ]
    # The code comes in a later utterance: the card is context, the code is still redacted.
    out = r.final(words_of_text("The code is 737."), "c", end_s=9.0)
    assert [(p, "".join(w.text for w in ws)) for p, ws in out] == [("c", "The code is [PCI].")]


def test_stream_releases_a_held_final_after_enough_audio_or_at_the_end() -> None:
    r: StreamRedactor[str] = StreamRedactor(PCI)
    assert r.final(words_of_text("Extension 4567"), "a", end_s=2.0) == []
    assert r.release_if_stale(2.0 + HOLD_AUDIO_S / 2) == []
    out = r.release_if_stale(2.0 + HOLD_AUDIO_S)
    assert [(p, "".join(w.text for w in ws)) for p, ws in out] == [("a", "Extension 4567")]
    assert r.final(words_of_text("Order 1234"), "b", end_s=20.0) == []
    assert [p for p, _ in r.release()] == ["b"]


def test_numbers_only_never_holds_back() -> None:
    r: StreamRedactor[str] = StreamRedactor(NUMBERS)
    out = r.final(words_of_text("Order 1234"), "a", end_s=1.0)
    assert [(p, "".join(w.text for w in ws)) for p, ws in out] == [("a", "Order [NUMBER]")]


def test_log_text_masks_an_open_digit_tail() -> None:
    r: StreamRedactor[str] = StreamRedactor(PCI)
    assert r.for_log(words_of_text("My card is 4111 1111")) == "My card is [PCI]"
    assert r.for_log(words_of_text("Thank you")) == "Thank you"
