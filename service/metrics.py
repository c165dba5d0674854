"""The service's Prometheus metrics (streams, utterances, latency) and the standard grpc_server_* set.

Labels are bounded: gRPC codes, method names of the registered services, and small fixed sets of
outcomes. Never a stream id, a peer or a language.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge, Histogram

from engine.api import TIME_BUCKETS

if TYPE_CHECKING:
    from service.vocabulary.call_metrics import CallMetrics

# Gauges name their multiprocess_mode: asr-server's frontend processes each keep their own values and
# /metrics combines those of the live ones (prometheus-client multiprocess mode; see service/runtime/supervisor.py).

# End of speech -> final sent: tens of milliseconds on a GPU to seconds on a busy CPU.
LATENCY_BUCKETS = (0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)

ACTIVE_STREAMS = Gauge("asr_active_streams", "Open streams, every door", multiprocess_mode="livesum")
STREAMS = Counter(
    "asr_streams_total",
    "Streams ended (every door, refusals too), by status code (gRPC's names)",
    ["grpc_code"],
)
UTTERANCE_LATENCY = Histogram(
    "asr_utterance_latency_seconds",
    "From an utterance's end being detected to its final result leaving the server",
    buckets=LATENCY_BUCKETS,
)
TIME_TO_FIRST_INTERIM = Histogram(
    "asr_time_to_first_interim_seconds",
    "From speech starting to the utterance's first interim result leaving the server",
    buckets=LATENCY_BUCKETS,
)
AUDIO_SECONDS = Counter(
    "asr_audio_seconds_total",
    "Seconds of audio received (per stream, not per channel), by channel mode (mono, mixdown, separate)",
    ["channel_mode"],
)
UTTERANCES = Counter(
    "asr_utterances_total",
    "Utterances by outcome: final (text sent), empty (silence or noise), cancelled, error",
    ["outcome"],
)
SPECULATIVE_ENDPOINTS = Counter(
    "asr_speculative_endpoints_total",
    "Utterances submitted to the engine before their end was confirmed (--speculative-endpointing), by "
    "outcome: hit (confirmed: that request became the final), miss (speech resumed: cancelled in the "
    "engine), refused (the engine refused or failed it: submitted again when confirmed)",
    ["outcome"],
)
for _outcome in ("hit", "miss", "refused"):  # at 0 from the start, so that rates and ratios have data
    SPECULATIVE_ENDPOINTS.labels(_outcome)
LIVE_DIARIZATION_LATE = Counter(
    "asr_live_diarization_late_total",
    "Live finals sent without speakers because their utterance's speaker embedding was not ready within "
    "--live-diarization-wait-s of the transcript (the diarization thread is behind)",
)
SPECULATIVE_WASTED_AUDIO = Counter(
    "asr_speculative_wasted_audio_seconds_total",
    "Audio of speculative requests cancelled on a miss: an upper bound of the engine work wasted (a "
    "request cancelled while still queued cost nothing)",
)
STREAM_BUFFER_SECONDS = Gauge(
    "asr_stream_buffer_seconds",
    "Audio received but not yet transcribed, summed over open streams (clients sending faster than real time)",
    multiprocess_mode="livesum",
)
RESPONSE_BACKLOG_BYTES = Gauge(
    "asr_response_backlog_bytes",
    "Responses queued for clients that have not read them yet (serialized bytes), summed over open streams; "
    "each stream's share is bounded by --max-response-backlog-bytes",
    multiprocess_mode="livesum",
)
# Every call of every door (service/recognizer/recognizer.py): `door` asr.v1, openai-http, ...; `kind` stream or
# recognize (a whole recording); `code` how it ended, google.rpc.Code names (as grpc_code above).
DOOR_CALLS = Counter(
    "asr_door_calls_total",
    "Calls ended, by door, kind (stream, recognize) and status code",
    ["door", "kind", "code"],
)
# Every refusal (or cut-off connection) by a per-caller bound, labelled by the flag that set it: what a
# misbehaving integration costs shows here before it shows in anyone else's latency.
LIMIT_REFUSALS = Counter(
    "asr_limit_refusals_total",
    "Requests refused, flushes held or connections cut by a bound on one caller, by the flag that sets it",
    ["limit"],
)


def refused(limit: str) -> None:
    """Count one refusal by the bound `limit` (the flag's name, underscores)."""
    LIMIT_REFUSALS.labels(limit=limit).inc()


RECOGNIZE_QUEUED = Gauge(
    "asr_recognize_queued_calls",
    "Recognize calls and HTTP transcriptions waiting past --max-recognize-calls (first come, first served)",
    multiprocess_mode="livesum",
)
DOOR_ACTIVE_CALLS = Gauge(
    "asr_door_active_calls",
    "Calls in progress, by door and kind",
    ["door", "kind"],
    multiprocess_mode="livesum",
)
RECOGNIZE_SECONDS = Histogram(
    "asr_recognize_seconds", "Wall time of one Recognize call (whole recording)", buckets=TIME_BUCKETS
)

# With frontend processes: SERVING only while every live frontend is (the lowest of them).
SERVING = Gauge(
    "asr_serving",
    "1 while health reports SERVING for asr.v1.Recognizer; 0 while loading, draining or failed",
    multiprocess_mode="livemin",
)
BUILD_INFO = Gauge(
    "asr_build_info",
    "Build of the running server (value 1)",
    ["version", "revision"],
    multiprocess_mode="livemax",
)
MODEL_INFO = Gauge(
    "asr_model_info",
    "Model the server runs (value 1)",
    ["model", "device", "dtype"],
    multiprocess_mode="livemax",
)

# The grpc_server_* family, named as go-grpc-prometheus / py-grpc-prometheus name them so the usual
# dashboards and alerts work unchanged.
GRPC_LABELS = ["grpc_type", "grpc_service", "grpc_method"]
GRPC_STARTED = Counter("grpc_server_started_total", "RPCs started on the server", GRPC_LABELS)
GRPC_HANDLED = Counter(
    "grpc_server_handled_total", "RPCs completed on the server, by status code", [*GRPC_LABELS, "grpc_code"]
)
GRPC_HANDLING_SECONDS = Histogram(
    "grpc_server_handling_seconds",
    "RPC handling time on the server (whole stream for streaming RPCs)",
    GRPC_LABELS,
    buckets=(
        0.005,
        0.01,
        0.025,
        0.05,
        0.1,
        0.25,
        0.5,
        1.0,
        2.5,
        5.0,
        10.0,
        30.0,
        60.0,
        300.0,
        1800.0,
        7200.0,
    ),
)
GRPC_MSG_RECEIVED = Counter("grpc_server_msg_received_total", "Messages received from clients", GRPC_LABELS)
GRPC_MSG_SENT = Counter("grpc_server_msg_sent_total", "Messages sent to clients", GRPC_LABELS)

# The OpenAI-compatible HTTP door (service/doors/openai_http.py); its recognitions also count in the asr_* set above.
HTTP_REQUESTS = Counter(
    "asr_http_requests_total", "HTTP requests to the OpenAI-compatible door ended, by HTTP status", ["code"]
)

# Endpointing cost (service/pipeline/vad_batch.py): one observation per batched VAD pass of a frontend process.
VAD_SECONDS = Histogram(
    "asr_vad_seconds",
    "Wall time of one batched VAD pass (every channel with new audio in one event-loop tick)",
    buckets=(0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5),
)
VAD_BATCH_CHANNELS = Histogram(
    "asr_vad_batch_channels",
    "Channels (streams, or each channel of a separately recognized stream) scored in one batched VAD pass",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
)
VAD_WINDOWS = Counter(
    "asr_vad_windows_total", "32 ms windows the streaming VAD was given (scored, or gated as line noise)"
)
VAD_WINDOWS_GATED = Counter(
    "asr_vad_windows_gated_total",
    "32 ms windows not scored by the VAD model: a channel's line noise after 0.5 s of non-speech "
    "(service/pipeline/noise_gate.py); every path, streams and Recognize",
)

# Call metrics (service/pipeline/call_metrics.py), one observation per call (stream or Recognize) as it
# ends: distributions over calls, no label per call. `channel` is the channel's position (channel_tag:
# 0 mixed down, 1..8 recognized separately), a handful of values.
SHARE_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
CALL_NON_TALK_SHARE = Histogram(
    "asr_call_non_talk_share",
    "Share of a call's audio in which no channel spoke (silences of at least min_non_talk_duration)",
    buckets=SHARE_BUCKETS,
)
CALL_TALK_SHARE = Histogram(
    "asr_call_talk_share",
    "Share of a call's audio in which a channel spoke, per channel position (channel_tag)",
    ["channel"],
    buckets=SHARE_BUCKETS,
)
CALL_OVERLAP_SHARE = Histogram(
    "asr_call_overlap_share",
    "Share of a call's audio in which two channels or more spoke at once",
    buckets=SHARE_BUCKETS,
)


def observe_call(m: CallMetrics) -> None:
    """One ended call's shares."""
    if m.total_s <= 0:
        return
    CALL_NON_TALK_SHARE.observe(m.non_talk_share)
    CALL_OVERLAP_SHARE.observe(m.overlap_s / m.total_s)
    for c in m.channels:
        CALL_TALK_SHARE.labels(str(c.channel_tag)).observe(m.talk_share(c.channel_tag))


# the call webhook (service/runtime/call_webhook.py)
CALL_WEBHOOK_POSTS = Counter(
    "asr_call_webhook_posts", "Call webhook requests, by outcome (delivered, retried)", ["outcome"]
)
CALL_WEBHOOK_DROPPED = Counter(
    "asr_call_webhook_dropped", "Call webhook messages dropped unsent: more than --call-webhook-queue waited"
)
CALL_WEBHOOK_WAITING = Gauge(
    "asr_call_webhook_waiting", "Call webhook messages waiting to be delivered", multiprocess_mode="livesum"
)
TURN_SECONDS = Histogram(
    "asr_turn_model_seconds",
    "Wall time of one batched turn-model call (every stream that asked whether its turn is over in one tick)",
    buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0),
)
TURN_BATCH = Histogram(
    "asr_turn_model_batch",
    "Turns judged in one batched turn-model call",
    buckets=(1, 2, 4, 8, 16, 32, 64),
)
