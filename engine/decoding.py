"""Whisper's decoding rules for greedy search: prompts, suppressed tokens, timestamps,
stopping, language detection, and turning tokens into text and segments.

Special token ids are read from the tokenizer, never hard-coded: multilingual vocabularies
put every special token one id higher than English-only ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from engine.constants import CHUNK_SECONDS
from engine.request import DecodeOptions, Request, Segment, validate_options

NO_SPEECH_THRESHOLD = 0.6  # openai/whisper's defaults for dropping silent windows
LOGPROB_THRESHOLD = -1.0
# Whisper's rule alone lets digital silence through as a confident "you" (no-speech 0.95,
# log-prob -0.38 on tiny.en); real speech here scores below 0.2. Above this, drop outright.
CONFIDENT_NO_SPEECH = 0.8
MAX_INITIAL_TIMESTAMP_S = 1.0
SECONDS_PER_TIMESTAMP = 0.02


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


class DecodingRules:
    def __init__(
        self, tokenizer: Any, generation_config: Any, n_vocab: int, multilingual: bool, device: torch.device
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab = Vocab.from_tokenizer(tokenizer, multilingual)
        self.n_vocab = n_vocab
        self.suppress = torch.zeros(n_vocab, dtype=torch.bool, device=device)
        self.suppress[list(generation_config.suppress_tokens or [])] = True
        self.suppress_begin = torch.zeros(n_vocab, dtype=torch.bool, device=device)
        self.suppress_begin[list(generation_config.begin_suppress_tokens or [])] = True
        self.non_language = torch.ones(n_vocab, dtype=torch.bool, device=device)
        self.non_language[list(self.vocab.languages.values())] = False

    # --- options and prompts ---
    def validate(self, options: DecodeOptions) -> None:
        validate_options(options, multilingual=self.vocab.multilingual, languages=self.vocab.languages)

    def build_prompt(self, req: Request, max_tokens: int, language: str | None = None) -> None:
        """Fill req.prompt_tokens, req.sot_index and req.forced (tokens to emit after the prompt).
        `language` overrides the options' (later windows reuse the detected one)."""
        v, opts = self.vocab, req.options
        language = language or opts.language
        # The prompt was tokenized (and its length bounded) once, at submit: engine/prompt.py.
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
    def next_tokens(self, logits: Tensor, reqs: list[Request]) -> tuple[Tensor, Tensor]:
        """Apply the rules to logits [B, V] (in place) and pick greedy tokens.
        Returns (tokens [B], their log-probabilities [B]) on the host, fetched in one copy: the
        rules themselves never wait for the device (which rows get which rule is known here)."""
        logits.masked_fill_(self.suppress, float("-inf"))
        for i, r in enumerate(reqs):
            if len(r.generated) == r.sample_begin and not r.forced:
                logits[i].masked_fill_(self.suppress_begin, float("-inf"))
            if r.options.timestamps and not r.forced:
                self._timestamp_rules(logits[i], r)
        logprobs = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1)
        # float64 holds every token id and float32 log-probability exactly.
        picked = torch.stack([tokens.double(), logprobs.gather(1, tokens[:, None])[:, 0].double()]).cpu()
        return picked[0].long(), picked[1]

    def detect_language(self, logits: Tensor) -> Tensor:
        """Most likely language token per row of logits [B, V]."""
        return logits.masked_fill(self.non_language, float("-inf")).argmax(dim=-1)

    def language_code(self, token: int) -> str:
        return next(code for code, tid in self.vocab.languages.items() if tid == token)

    def no_speech_prob(self, sot_logits: Tensor) -> Tensor:
        return torch.softmax(sot_logits.float(), dim=-1)[:, self.vocab.no_speech]

    def _timestamp_rules(self, logits: Tensor, req: Request) -> None:
        """openai/whisper's ApplyTimestampRules for one sequence."""
        v = self.vocab
        ts = v.timestamp_begin
        seq = req.generated[req.sample_begin :]  # sampled tokens only: not the language or task
        logits[v.no_timestamps] = float("-inf")
        last_was_ts = len(seq) >= 1 and seq[-1] >= ts
        penultimate_was_ts = len(seq) < 2 or seq[-2] >= ts
        if last_was_ts:
            if penultimate_was_ts:  # a pair closed a segment: text must follow
                logits[ts:] = float("-inf")
            else:  # text then a timestamp: another timestamp (or the end) must follow
                logits[: v.eot] = float("-inf")
        stamps = [t for t in seq if t >= ts]
        if stamps:
            # Timestamps never go backwards; a segment's end is strictly after its start.
            floor = stamps[-1] if (last_was_ts and not penultimate_was_ts) else stamps[-1] + 1
            logits[ts:floor] = float("-inf")
        if not seq:
            logits[:ts] = float("-inf")
            last_allowed = ts + round(MAX_INITIAL_TIMESTAMP_S / SECONDS_PER_TIMESTAMP)
            logits[last_allowed + 1 :] = float("-inf")
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        # As a device-side condition (no `if` on a tensor: that would wait for the device).
        timestamp_likelier = torch.logsumexp(logprobs[ts:], dim=-1) > logprobs[:ts].max()
        logits[:ts].masked_fill_(timestamp_likelier, float("-inf"))

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
