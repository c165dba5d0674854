"""Whisper's decoding rules for greedy search: prompts, suppressed tokens, timestamps, keyterms,
stopping, language detection, and turning tokens into text and segments. The rules that edit logits
are composable processors (engine/decoding/logits.py, engine/decoding/keyterms.py), applied in order over a whole step.

Special token ids are read from the tokenizer, never hard-coded: multilingual vocabularies
put every special token one id higher than English-only ones.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from engine.constants import CHUNK_SECONDS
from engine.decoding.beam import TermBias
from engine.decoding.keyterms import KeytermBias, KeytermSettings
from engine.decoding.logits import (
    SECONDS_PER_TIMESTAMP,
    ApplyTimestampRules,
    LogitProcessor,
    StepRows,
    SuppressBlank,
    SuppressTokens,
)
from engine.outputs import Segment
from engine.parameters import DecodeOptions, check_keyterm_tokens, validate_beam_size, validate_options
from engine.scheduling.request import Beam, Request

NO_SPEECH_THRESHOLD = 0.6  # openai/whisper's defaults for dropping silent windows
LOGPROB_THRESHOLD = -1.0
# Whisper's rule alone lets digital silence through as a confident "you" (no-speech 0.95,
# log-prob -0.38 on tiny.en); real speech here scores below 0.2. Above this, drop outright.
CONFIDENT_NO_SPEECH = 0.8


@dataclass(frozen=True)
class Vocab:
    sot: int
    eot: int
    sot_prev: int
    no_speech: int
    no_timestamps: int
    timestamp_begin: int
    transcribe: int
    translate: int
    languages: dict[str, int]  # "en" -> id of <|en|>
    multilingual: bool

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, multilingual: bool) -> Vocab:
        ids = tokenizer.convert_tokens_to_ids
        no_timestamps = ids("<|notimestamps|>")
        no_speech = ids("<|nospeech|>")
        if no_speech is None or no_speech == tokenizer.unk_token_id:
            no_speech = ids("<|nocaptions|>")
        languages: dict[str, int] = {}
        if multilingual:
            for token_id in range(ids("<|startoftranscript|>") + 1, ids("<|translate|>")):
                token = tokenizer.convert_ids_to_tokens(token_id)
                languages[token[2:-2]] = token_id
        return cls(
            sot=ids("<|startoftranscript|>"),
            eot=ids("<|endoftext|>"),
            sot_prev=ids("<|startofprev|>"),
            no_speech=no_speech,
            no_timestamps=no_timestamps,
            timestamp_begin=no_timestamps + 1,
            transcribe=ids("<|transcribe|>"),
            translate=ids("<|translate|>"),
            languages=languages,
            multilingual=multilingual,
        )


@dataclass(frozen=True)
class Choice:
    """One sampling step's choice for its rows, on the host: the tokens, their log-probabilities under
    the rules before any bias, and what the keyterm bias reports per row (None: no row has keyterms)."""

    tokens: Tensor  # [B] int64
    logprobs: Tensor  # [B] float64
    keyterm: list[dict[str, float]] | None = None


class DecodingRules:
    def __init__(
        self,
        tokenizer: Any,
        generation_config: Any,
        n_vocab: int,
        multilingual: bool,
        device: torch.device,
        keyterms: KeytermSettings | None = None,
        max_beam_size: tuple[int, str] = (1, "--max-beam-size"),
    ) -> None:
        self.tokenizer = tokenizer
        self.max_beam_size = max_beam_size  # the bound and the flag that sets it
        self.vocab = Vocab.from_tokenizer(tokenizer, multilingual)
        self.n_vocab = n_vocab
        self.keyterm_settings = keyterms or KeytermSettings()
        suppress = torch.zeros(n_vocab, dtype=torch.bool, device=device)
        suppress[list(generation_config.suppress_tokens or [])] = True
        suppress_begin = torch.zeros(n_vocab, dtype=torch.bool, device=device)
        suppress_begin[list(generation_config.begin_suppress_tokens or [])] = True
        self.non_language = torch.ones(n_vocab, dtype=torch.bool, device=device)
        self.non_language[list(self.vocab.languages.values())] = False
        self.keyterms = KeytermBias(tokenizer, self.vocab.eot, n_vocab, device, self.keyterm_settings)
        # In order, as openai/whisper's LogitFilters: masks first, then the bias over what is left.
        self.processors: list[LogitProcessor] = [
            SuppressTokens(suppress),
            SuppressBlank(suppress_begin),
            ApplyTimestampRules(self.vocab, n_vocab, device),
            self.keyterms,
        ]

    # --- options and prompts ---
    def validate(self, options: DecodeOptions) -> None:
        validate_options(options, multilingual=self.vocab.multilingual, languages=self.vocab.languages)
        validate_beam_size(options.beam_size, *self.max_beam_size)
        if options.keyterms:
            self._check_keyterm_tokens(tuple(options.keyterms))

    @functools.lru_cache(maxsize=256)  # noqa: B019 - the rules live as long as the engine; a call's list repeats
    def _check_keyterm_tokens(self, keyterms: tuple[str, ...]) -> None:
        """The bound only the tokenizer can check (cached: every utterance of a call brings its list)."""
        check_keyterm_tokens(
            keyterms, lambda text: len(self.tokenizer.encode(text, add_special_tokens=False))
        )

    def previous_text(self, options: DecodeOptions, prompt_ids: tuple[int, ...]) -> tuple[int, ...]:
        """The token ids Whisper conditions on as previous text: the caller's prompt (tokenized once, at
        submit: engine/decoding/prompt.py), after the keyterms when the prompt layer is on (as faster-whisper's
        hotwords). Bounded by the keyterm bounds, so tokenizing them costs little; build_prompt keeps the
        tail when the two together are too long."""
        if not (options.keyterms and self.keyterm_settings.prompt):
            return prompt_ids
        text = " " + ", ".join(t.strip() for t in options.keyterms) + "."
        terms = [t for t in self.tokenizer.encode(text, add_special_tokens=False) if t < self.vocab.eot]
        return (*terms, *prompt_ids)

    def build_prompt(self, req: Request, max_tokens: int, language: str | None = None) -> None:
        """Fill req.prompt_tokens, req.sot_index and req.forced (tokens to emit after the prompt).
        `language` overrides the options' (later windows reuse the detected one)."""
        v, opts = self.vocab, req.options
        language = language or opts.language
        # The prompt was tokenized (and its length bounded) once, at submit: engine/decoding/prompt.py.
        keep = max(0, min(len(req.prompt_ids), max_tokens // 2 - 1))
        prefix = [v.sot_prev, *req.prompt_ids[len(req.prompt_ids) - keep :]] if keep else []
        tail: list[int] = []
        if v.multilingual:
            tail.append(v.translate if opts.task == "translate" else v.transcribe)
        if not opts.timestamps:
            tail.append(v.no_timestamps)
        req.sot_index = len(prefix)
        if v.multilingual and language is None:
            # Detect the language from the logits after <|startoftranscript|>, then force the rest.
            req.prompt_tokens = [*prefix, v.sot]
            req.forced = tail
            req.detect_language = True
            req.sample_begin = 1 + len(tail)  # the language token, then the forced ones
        else:
            language = language or "en"
            lang = [v.languages[language]] if v.multilingual else []
            req.prompt_tokens = [*prefix, v.sot, *lang, *tail]
            req.forced = []
            req.detect_language = False
            req.sample_begin = 0
            req.language = language

    # --- logits -> next tokens ---
    def start_window(self, req: Request) -> None:
        """Per-window rule state (the keyterm bias's), before the window's first token is chosen."""
        self.keyterms.start_window(req)
        if req.temperature > 0:  # the greedy keyterm bias chooses tokens itself: a sample takes none
            req.keyterm = None

    def next_tokens(self, logits: Tensor, reqs: Sequence[Request]) -> Choice:
        """Apply the rules to logits [B, V] (in place; row i is reqs[i]) and pick greedy tokens.
        Everything comes back to the host in one copy: the rules themselves never wait for the device."""
        rows = StepRows.of(reqs)
        for processor in self.processors:
            processor.apply(logits, rows)
        tokens = logits.argmax(dim=-1) if rows.tokens is None else rows.tokens
        hot = [i for i, r in enumerate(reqs) if r.temperature > 0]
        if hot:
            tokens = self._sample(logits, tokens, hot, reqs)
        logprobs = rows.logprobs(logits).gather(1, tokens[:, None])[:, 0]
        names = list(rows.fetch)
        # float64 holds every token id, node and float32 log-probability exactly.
        picked = torch.stack([tokens.double(), logprobs.double(), *(rows.fetch[k].double() for k in names)])
        host = picked.cpu()
        keyterm = None
        if names:
            values = host[2:].T.tolist()
            keyterm = [dict(zip(names, row, strict=True)) for row in values]
        return Choice(host[0].long(), host[1], keyterm)

    @staticmethod
    def _sample(logits: Tensor, tokens: Tensor, hot: list[int], reqs: Sequence[Request]) -> Tensor:
        """`tokens` with rows `hot` sampled from softmax(logits / temperature) under the rules' masks, as
        openai/whisper's GreedyDecoder at a temperature above 0. Each draw is the row's own request's
        (Request.draw: its own generator), turned into a token by the row's cumulative distribution on the
        device, so a row's sample depends on its logits and its generator only, never on its batch."""
        device = logits.device
        picked = [reqs[i] for i in hot]
        index = torch.tensor(hot, device=device)
        scale = torch.tensor([r.temperature for r in picked], device=device, dtype=torch.float32)
        probs = torch.softmax(logits[index].float() / scale[:, None], dim=-1).double()
        cdf = probs.cumsum(dim=-1)
        draws = torch.tensor([r.draw() for r in picked], device=device, dtype=torch.float64)
        # The first token whose cumulative probability passes the draw: never a masked one (probability 0).
        chosen = torch.searchsorted(cdf, (draws * cdf[:, -1])[:, None], right=True)[:, 0]
        out = tokens.clone()
        out[index] = chosen.clamp_(max=logits.shape[-1] - 1)
        return out

    def beam_candidates(
        self, logits: Tensor, beams: Sequence[Beam], k: int, bias: TermBias | None = None
    ) -> tuple[list[list[float]], list[list[int]]]:
        """Apply the rules to logits [B, V] (in place; row i is beams[i]) and return each row's k likeliest
        tokens and their log-probabilities (openai/whisper's BeamSearchDecoder ranks these). The same
        processors as greedy decoding, in the same order: suppressed tokens, blank at the first sampled
        token, timestamp rules. With a keyterm `bias`, the k are chosen with the bonus of the tokens
        that continue or start a term (engine/decoding/beam.py ranks them with it); the log-probabilities are the
        model's."""
        rows = StepRows.of(beams)
        for processor in self.processors:
            processor.apply(logits, rows)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        if bias is None:
            values, tokens = logprobs.topk(k, dim=-1)
        else:
            boosted = [
                (i, token)
                for i, b in enumerate(beams)
                if b.terms is not None
                for token in b.terms.boosted(bias.trie, bias.boundary(b))
            ]
            ranked = logprobs.clone()
            if boosted:
                where = torch.tensor(boosted, device=logits.device).T
                ranked[where[0], where[1]] += bias.per_token
            tokens = ranked.topk(k, dim=-1).indices
            values = logprobs.gather(1, tokens)
        host = torch.stack([values.double(), tokens.double()]).cpu()  # one copy; float64 holds every id
        return host[0].tolist(), host[1].long().tolist()

    def take(self, reqs: Sequence[Request], choice: Choice) -> list[tuple[Request, Exception]]:
        """Append each row's chosen token to its request (a keyterm take-back first returns the row
        to where its match began). Returns the requests whose update failed, each with its error."""
        keyterm = choice.keyterm
        failed: list[tuple[Request, Exception]] = []
        for i, (req, token, logprob) in enumerate(
            zip(reqs, choice.tokens.tolist(), choice.logprobs.tolist(), strict=True)
        ):
            try:
                self.keyterms.take(req, token, logprob, keyterm[i] if keyterm is not None else None)
            except Exception as exc:  # this row's state only; the others go on
                failed.append((req, exc))
        return failed

    def detect_language(self, logits: Tensor) -> Tensor:
        """Most likely language token per row of logits [B, V]."""
        return logits.masked_fill(self.non_language, float("-inf")).argmax(dim=-1)

    def language_code(self, token: int) -> str:
        return next(code for code, tid in self.vocab.languages.items() if tid == token)

    def no_speech_prob(self, sot_logits: Tensor) -> Tensor:
        return torch.softmax(sot_logits.float(), dim=-1)[:, self.vocab.no_speech]

    # --- tokens -> text ---
    def text(self, tokens: list[int]) -> str:
        text_tokens = [t for t in tokens if t < self.vocab.eot]
        return str(self.tokenizer.decode(text_tokens, skip_special_tokens=True)).strip()

    def segments(self, tokens: list[int], offset_s: float) -> list[Segment]:
        ts = self.vocab.timestamp_begin
        segments: list[Segment] = []
        start: float | None = None
        text_tokens: list[int] = []
        for t in tokens:
            if t >= ts:
                seconds = (t - ts) * SECONDS_PER_TIMESTAMP + offset_s
                if start is None:
                    start = seconds
                else:
                    if text_tokens:
                        segments.append(Segment(self.text(text_tokens), start, seconds))
                    start, text_tokens = None, []
            elif t < self.vocab.eot:
                text_tokens.append(t)
        if text_tokens:  # unclosed final segment
            segments.append(
                Segment(
                    self.text(text_tokens), start if start is not None else offset_s, offset_s + CHUNK_SECONDS
                )
            )
        return segments

    @staticmethod
    def is_silence(no_speech_prob: float, avg_logprob: float, text: str) -> bool:
        if not text or no_speech_prob > CONFIDENT_NO_SPEECH:
            return True
        return no_speech_prob > NO_SPEECH_THRESHOLD and avg_logprob < LOGPROB_THRESHOLD
