"""What the parts of a live stream's session share (service/pipeline/session.py wires the parts: intake.py,
finals.py, interims.py, outbox.py): each channel's state, the pieces more than one part feeds, and what the
parts ask of the session."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from engine.api import DecodeOptions, UtteranceHandle
from service.pipeline.call_metrics import CallMetricsTracker
from service.pipeline.context import ChannelContext
from service.pipeline.endpointing import Endpointer, ManualTurns, Utterance
from service.pipeline.interim import InterimPolicy
from service.pipeline.options import StreamPlan
from service.pipeline.outbox import Outbox
from service.pipeline.results import ChannelResults, ResultOptions
from service.pipeline.session_settings import SessionSettings, turn_judging
from service.pipeline.speculation import Speculations
from service.pipeline.stream_state import StreamState
from service.vocabulary.engine import RecognitionEngine
from service.vocabulary.errors import RecognitionError
from service.vocabulary.types import EndReason

if TYPE_CHECKING:  # torch is imported only by a frontend asked to diarize
    from service.pipeline.live_diarization import Embedded, LiveSpeakers


@dataclass
class Pending:
    """An utterance submitted to the engine, waiting for its final."""

    utterance: Utterance
    handle: UtteranceHandle
    ready_time: float
    ended_by: EndReason
    embedding: concurrent.futures.Future[Embedded] | None = None  # live diarization, started at submit


@dataclass
class Channel:
    tag: int  # channel_tag in results: 1-based when channels are recognized separately, else 0
    endpointer: Endpointer | ManualTurns
    finals: asyncio.Queue[Pending | None] = field(default_factory=asyncio.Queue)
    unsettled: collections.deque[Pending] = field(default_factory=collections.deque)
    next_index: int = 0  # index the utterance now being spoken will get
    settled: int = 0  # utterances [0, settled) have had their final handled
    cleared: int = 0  # utterances below this index were dropped by clear(): no interim of theirs goes out
    speech_start_s: float = 0.0  # where the utterance in progress began (for interim offsets)
    speech_start_wall: float = 0.0
    interim: InterimPolicy = field(default_factory=lambda: InterimPolicy(0.0))
    options: DecodeOptions = field(default_factory=DecodeOptions)  # the utterance in progress is decoded so
    results: ChannelResults = field(default_factory=lambda: ChannelResults(ResultOptions(), 0))
    # this channel's earlier finals, carried into its next utterances (pipeline/context.py)
    context: ChannelContext = field(default_factory=lambda: ChannelContext(0, lambda text, n: ""))
    # diarized: the channel's live speakers (a mono or mixed-down channel), or its fixed speaker (a
    # separate channel is one speaker: tag 1 is speaker 0, as on recordings)
    speakers: LiveSpeakers | None = None
    fixed_speaker: int | None = None

    def next_options(self) -> DecodeOptions:
        """What the channel's next utterance is decoded with: its options, and its own earlier text."""
        context = self.context.value
        return self.options if context is None else dataclasses.replace(self.options, context=context)


def build_channels(plan: StreamPlan, engine: RecognitionEngine, settings: SessionSettings) -> list[Channel]:
    """The stream's channels: one per channel recognized separately, else one for the (mixed-down) audio."""
    n = plan.channels if plan.separate_channels else 1
    ep = plan.endpointing
    channels = [
        Channel(
            tag=i + 1 if plan.separate_channels else 0,
            endpointer=ManualTurns()
            if ep is None
            else Endpointer(
                ep,
                speculative=settings.speculative_endpointing,
                gate_margin_db=settings.vad_gate_db,
                turn=turn_judging(ep, settings),
            ),
        )
        for i in range(n)
    ]
    carry = settings.context_carry if plan.context_carry is None else plan.context_carry
    prompts = engine.info.prompts  # the engine's tokenizer bounds the carried text in its tokens
    carry_tokens = settings.context_carry_tokens if carry and prompts is not None else 0
    for ch in channels:
        ch.results = ChannelResults(plan.results, ch.tag)
        ch.interim = InterimPolicy(settings.interim_interval_s)
        ch.options = plan.options
        ch.context = ChannelContext(carry_tokens, prompts.tail if prompts is not None else ch.context.tail)
    if plan.diarization is not None:
        _start_diarization(channels, plan, settings)
    return channels


def _start_diarization(channels: list[Channel], plan: StreamPlan, settings: SessionSettings) -> None:
    if plan.separate_channels:
        for ch in channels:
            ch.fixed_speaker = ch.tag - 1
        return
    from service.pipeline.live_diarization import LiveSpeakers, warm

    assert plan.diarization is not None
    warm()  # the models load while the first utterance is spoken
    for ch in channels:
        ch.speakers = LiveSpeakers(plan.diarization.max_speakers or settings.max_diarization_speakers)


class StreamHost(Protocol):
    """The session, as its parts call back on it: the stream's life is its alone."""

    @property
    def state(self) -> StreamState: ...

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run `coro` as one of the stream's tasks (stopped when the stream closes)."""
        ...

    def finish_input(self, *, flush: bool) -> None:
        """No more audio: optionally endpoint what was heard as if the client half-closed, then let the
        finals drain and end the stream."""
        ...

    def end_after_admitted(self, error: RecognitionError) -> None:
        """Stop taking audio; what was admitted gets its final, then the first such `error` ends the stream."""
        ...

    def fail_with(self, e: Exception, what: str) -> None:
        """End the stream for `e` (its field named when it is bad input; logged when it is a bug)."""
        ...


@dataclass(frozen=True)
class SessionShared:
    """One stream's, as each part of its session sees it."""

    host: StreamHost
    id: str
    plan: StreamPlan  # but for its decoding options, which update_options changes (intake.py OptionChanges)
    flags: SessionSettings
    engine: RecognitionEngine
    channels: list[Channel]
    speculations: Speculations  # offered and cancelled by the intake, taken by the finals
    # fed with the confirmed utterances (never speculative ends), the finals' words and the speech audio
    call_metrics: CallMetricsTracker
    outbox: Outbox
