"""The initial prompt (`DecodeOptions.prompt`): its bounds, and the token ids Whisper conditions on.

Whisper conditions on at most `n_text_ctx // 2 - 1` prompt tokens (openai/whisper: 223 of its 448); this
engine's slots hold `--max-tokens` tokens (prompt + generated), so it keeps at most `--max-tokens // 2 - 1`
(111 at the default 224). A longer prompt is refused, not silently cut. So that the tokenizer never sees
megabytes, the text is first bounded in characters (engine/parameters.py MAX_PROMPT_CHARS, above what even
Whisper's 223 tokens spell: ~1000 characters of English, ~500 of product names).

`PromptEncoder` tokenizes exactly as the engine conditions (tokens the model would take for special
ones, `<|endoftext|>` typed by a client, are read as text) and remembers recent prompts, so that a
stream's prompt is tokenized once, not for every utterance, interim, window and fallback. It pickles as
its tokenizer's JSON, so a frontend process checks a prompt's length in tokens (from `ModelInfo`) before
anything reaches the engine.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from engine.parameters import check_prompt_chars

WHISPER_MAX_PROMPT_TOKENS = 223  # openai/whisper: n_text_ctx // 2 - 1 with its 448 text positions
_CACHED_PROMPTS = 256  # distinct prompts remembered (one per stream configuration in use)


def max_prompt_tokens(max_tokens: int) -> int:
    """Prompt tokens a slot of `max_tokens` keeps: half of it, as openai/whisper halves its context."""
    return max(0, min(WHISPER_MAX_PROMPT_TOKENS, max_tokens // 2 - 1))


class PromptEncoder:
    """Prompt text -> the token ids the decoder is prompted with (after <|startofprev|>)."""

    def __init__(self, tokenizer_json: str, eot: int, max_tokens: int) -> None:
        """`tokenizer_json`: a `tokenizers.Tokenizer` as JSON; `eot`: <|endoftext|>, the first id that is
        not text; `max_tokens`: the most prompt tokens accepted (max_prompt_tokens(--max-tokens))."""
        self.tokenizer_json = tokenizer_json
        self.eot = eot
        self.max_tokens = max_tokens
        self._tokenizer: Any = None
        self._lock = threading.Lock()
        self._cached = functools.lru_cache(maxsize=_CACHED_PROMPTS)(self._encode)

    def __getstate__(self) -> dict[str, Any]:
        return {"tokenizer_json": self.tokenizer_json, "eot": self.eot, "max_tokens": self.max_tokens}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["tokenizer_json"], state["eot"], state["max_tokens"])  # type: ignore[misc]

    def encode(self, prompt: str | None) -> tuple[int, ...]:
        """The prompt's token ids (() for no prompt). Raises ValueError naming `prompt` and the limit
        when it is over MAX_PROMPT_CHARS characters or `max_tokens` tokens."""
        if not prompt or not prompt.strip():
            return ()
        check_prompt_chars(prompt)
        return self._cached(prompt)

    def with_context(self, prompt_ids: tuple[int, ...], context: str | None) -> tuple[int, ...]:
        """`prompt_ids` (the caller's prompt, kept whole), then the tail of `context` (a channel's earlier
        text) that fits in the rest of the bound: the newest words are the ones the next utterance
        continues. Not remembered: the context changes with every utterance."""
        room = self.max_tokens - len(prompt_ids)
        if not context or not context.strip() or room <= 0:
            return prompt_ids
        ids = self._text_ids(" " + context.strip())
        return (*prompt_ids, *ids[max(0, len(ids) - room) :])

    def tail(self, text: str, max_tokens: int) -> str:
        """The end of `text` in at most about `max_tokens` tokens, cut where a token begins (the server's
        bound on the text it carries from one utterance to the next: --context-carry-tokens)."""
        if max_tokens <= 0:
            return ""
        encoding = self._backend().encode(text, add_special_tokens=False)
        if len(encoding.ids) <= max_tokens:
            return text
        return text[encoding.offsets[len(encoding.ids) - max_tokens][0] :].strip()

    def text_tokens(self, text: str) -> int:
        """How many tokens the model's tokenizer spells `text` in, as it is (the keyterm bound's measure:
        engine/scheduling/request.py check_keyterm_tokens)."""
        return len(self._backend().encode(text, add_special_tokens=False).ids)

    def _encode(self, prompt: str) -> tuple[int, ...]:
        # Whisper's prompt convention: one leading space, as the prompt continues earlier speech.
        ids = self._text_ids(" " + prompt.strip())
        if len(ids) > self.max_tokens:
            raise ValueError(
                f"prompt is {len(ids)} tokens, over the limit of {self.max_tokens} tokens (the decoder keeps "
                f"--max-tokens / 2 - 1 prompt tokens; Whisper's own bound is {WHISPER_MAX_PROMPT_TOKENS}); "
                "shorten it"
            )
        return tuple(ids)

    def _text_ids(self, text: str) -> list[int]:
        return [t for t in self._backend().encode(text, add_special_tokens=False).ids if t < self.eot]

    def _backend(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                from tokenizers import Tokenizer

                tokenizer = Tokenizer.from_str(self.tokenizer_json)
                # "<|endoftext|>" typed into a prompt is text, never the control token itself.
                tokenizer.encode_special_tokens = True
                self._tokenizer = tokenizer
            return self._tokenizer
