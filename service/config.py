"""The server's settings: one typed place, and the `asr-server` command line built from it.

Every field of `ServerConfig` (and of the engine's `EngineConfig`) becomes a kebab-case flag whose
help text is the field's `metadata["help"]`; booleans are spelled `on|off` so that a Kubernetes
manifest can set them either way without a negated flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import os
import sys
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_origin

from engine.api import EngineConfig
from service.pipeline.noise_gate import MARGIN_DB

LogFormat = Literal["json", "text"]
LogLevel = Literal["debug", "info", "warning", "error"]


@dataclass
class ServerConfig:
    host: str = field(default="[::]", metadata={"help": "address to bind the gRPC server to"})
    port: int = field(default=50051, metadata={"help": "gRPC port"})
    audiosocket_port: int = field(
        default=0,
        metadata={
            "help": "TCP port of the Asterisk AudioSocket door (AudioSocket() in the dialplan; 9092 by "
            "convention); it carries no credentials, so only the allowed peers may connect (0: off)"
        },
    )
    audiosocket_host: str = field(
        default="127.0.0.1",
        metadata={"help": "address the AudioSocket door binds to (the PBX's side of the network only)"},
    )
    audiosocket_allowed_peers: str = field(
        default="127.0.0.0/8,::1/128",
        metadata={
            "help": "comma-separated addresses or CIDR blocks allowed to connect to the AudioSocket door "
            "(the PBXs); any other is closed before a byte is read"
        },
    )
    siprec_port: int = field(
        default=0,
        metadata={
            "help": "UDP and TCP port of the SIPREC (RFC 7866) recording-server door, where an SBC or PBX "
            "sends its recording sessions (5060 by convention); SIP carries no credentials, so only the "
            "allowed peers are answered, others get 403 (0: off)"
        },
    )
    siprec_host: str = field(
        default="127.0.0.1",
        metadata={
            "help": "address the SIPREC door's SIP and RTP sockets bind to (the SBC's side of the network)"
        },
    )
    siprec_media_address: str = field(
        default="",
        metadata={
            "help": "the address the SIPREC door's SDP answers and Contact give the SBC, where it sends RTP "
            "and in-dialog requests (empty: --siprec-host, or this host's address when that is 0.0.0.0 or ::)"
        },
    )
    siprec_allowed_peers: str = field(
        default="127.0.0.0/8,::1/128",
        metadata={
            "help": "comma-separated addresses or CIDR blocks allowed to send SIP to the SIPREC door (the "
            "SBCs); any other request is answered 403 Forbidden"
        },
    )
    siprec_rtp_ports: str = field(
        default="20000-20999",
        metadata={
            "help": "the UDP port range (FIRST-LAST) the SIPREC door receives RTP on, one even port per "
            "recorded stream (expose it as a range in Kubernetes); an INVITE when no ports are free is "
            "answered 503 with Retry-After"
        },
    )
    siprec_rtp_timeout: float = field(
        default=300.0,
        metadata={
            "help": "seconds a SIPREC recording may go without an RTP packet on any leg (an SRC that died "
            "without a BYE, or a hold that long) before the door ends it, its last words transcribed, and "
            "sends the SRC a BYE; its place under --max-streams is freed (0: off)"
        },
    )
    siprec_max_message_bytes: int = field(
        default=65536,
        metadata={
            "help": "largest SIP message (headers and multipart body) the SIPREC door reads; a larger one "
            "is answered 513 Message Too Large (over TCP the connection is then closed)"
        },
    )
    metrics_port: int = field(default=9464, metadata={"help": "Prometheus /metrics HTTP port (0: off)"})
    metrics_host: str = field(
        default="",
        metadata={
            "help": "address the /metrics port binds to (empty: the same as --host); e.g. 127.0.0.1 or a "
            "pod-internal address, so the metrics are not served on every interface the calls come in on"
        },
    )
    http_port: int = field(
        default=8000,
        metadata={
            "help": "HTTP port of the HTTP doors: OpenAI's POST /v1/audio/transcriptions and Realtime "
            "WebSocket /v1/realtime, Deepgram's /v1/listen; same tokens, limits and TLS as gRPC (0: off)"
        },
    )
    http_read_timeout: float = field(
        default=30.0,
        metadata={
            "help": "HTTP door: seconds an upload may send nothing (and the grace before "
            "--http-min-upload-rate applies); then 408 and the connection is closed"
        },
    )
    http_idle_timeout: float = field(
        default=15.0,
        metadata={
            "help": "HTTP port: seconds a connection may go without a complete request head (idle between "
            "keep-alive requests, or a request line and headers sent by halves); then it is closed (aiohttp's "
            "own default is about an hour, for anyone, before any token is read)"
        },
    )
    http_max_connections: int = field(
        default=1024,
        metadata={
            "help": "HTTP port: connections one frontend process holds open at once (WebSocket streams, uploads, "
            "idle keep-alive); a connection past it is answered 503 naming this flag, with Retry-After, and "
            "closed before anything is read, so open sockets cannot exhaust the process's file descriptors "
            "and lock out the calls on it (0: no limit)"
        },
    )
    http_min_upload_rate: int = field(
        default=32 << 10,
        metadata={
            "help": "HTTP door: slowest average upload (bytes/s) after --http-read-timeout's grace; slower "
            "gets 408, so a trickling client cannot hold a handler and up to --max-recognize-bytes for long "
            "(the default, 4x real time of 8 kHz G.711, takes a 64 MiB upload in at most ~35 min; 0: off)"
        },
    )
    max_streams: int = field(
        default=256,
        metadata={"help": "most concurrent StreamingRecognize calls; beyond it RESOURCE_EXHAUSTED"},
    )
    max_streams_per_token: int = field(
        default=0,
        metadata={
            "help": "most concurrent streams one token may hold (with --auth-tokens-file; across every frontend "
            "process, as --max-streams); beyond it RESOURCE_EXHAUSTED naming this flag. Give each tenant or "
            "integration its own token and set this so that one cannot take every --max-streams place "
            "(0: no limit per token: one contact-center integration often holds them all)"
        },
    )
    max_stream_seconds: float = field(
        default=4 * 3600.0, metadata={"help": "longest audio one stream may carry; beyond it OUT_OF_RANGE"}
    )
    max_chunk_bytes: int = field(
        default=1 << 20, metadata={"help": "largest audio_content in one streaming request (bytes)"}
    )
    max_finals_in_flight: int = field(
        default=4,
        metadata={
            "help": "live finals one stream may have waiting for the engine (all channels): a client flush "
            "past it (Deepgram Finalize, Realtime commit) waits for one of them (Deepgram) or is refused "
            "(Realtime rate_limit_exceeded; the audio stays uncommitted), so a stream that flushes faster than "
            "it is served merges its own turns instead of filling the queue every stream shares (0: no limit)"
        },
    )
    ws_send_timeout: float = field(
        default=10.0,
        metadata={
            "help": "WebSocket doors (Deepgram, Realtime): seconds one message to the client (or the close) "
            "may wait for a client that is not reading; past it the connection is aborted, the stream ends and "
            "its --max-streams place is given back (0: wait for ever)"
        },
    )
    max_text_messages_per_s: float = field(
        default=200.0,
        metadata={
            "help": "WebSocket doors: text messages one connection may send per second, with a burst of twice "
            "that (Deepgram controls; Realtime events, audio appends included: 20 ms appends are 50/s); past it "
            "Deepgram closes the stream 1008 and Realtime answers each with an error rate_limit_exceeded and "
            "drops it, before it is parsed (0: no limit)"
        },
    )
    max_keyterm_updates_per_s: float = field(
        default=2.0,
        metadata={
            "help": "keyterm updates one stream may make per second (Deepgram Configure, Realtime "
            "session.update, asr.v1 keyterms_update), with a burst of 10; past it the update is refused "
            "RESOURCE_EXHAUSTED in the door's terms and the stream's keyterms stay as they were; a list "
            "equal to the current one is answered without work and not counted (0: no limit)"
        },
    )
    max_recognize_bytes: int = field(
        default=64 << 20, metadata={"help": "largest audio_content of one Recognize request (bytes)"}
    )
    max_recognize_seconds: float = field(
        default=4 * 3600.0,
        metadata={
            "help": "longest recording one Recognize call may hold, read from its header before anything is "
            "decoded (a 50 MB FLAC of silence can hold 10 h); beyond it OUT_OF_RANGE. 4 h as "
            "--max-stream-seconds: a recorded call is no longer than a live one"
        },
    )
    max_diarization_seconds: float = field(
        default=3600.0,
        metadata={
            "help": "longest recording that may ask for speaker diarization (its mono audio is kept at 2 bytes "
            "a sample until the call is clustered: 115 MB an hour); beyond it OUT_OF_RANGE naming the "
            "door's diarization option; default 1 h (0: diarization refused)"
        },
    )
    max_diarization_speakers: int = field(
        default=10,
        metadata={
            "help": "most speakers a diarization request may bound its count by (min/max speakers); a larger "
            "bound is refused INVALID_ARGUMENT naming the field; default 10"
        },
    )
    live_diarization_wait_s: float = field(
        default=1.0,
        metadata={
            "help": "longest a live stream's final waits for its speakers once its transcript is ready (the "
            "utterance is embedded while it is decoded, so it rarely waits); past it the final goes out "
            "on time without speaker fields; default 1 s (0: a final never waits: speakers only when ready)"
        },
    )
    recognize_inflight: int = field(
        default=8,
        metadata={
            "help": "utterances of one Recognize call in the engine at once: a recording of any length is "
            "fed through this window as it is decoded, so one long file cannot fill the engine's queue "
            "(--max-queue) ahead of live calls; larger batches it better, smaller leaves live calls more room"
        },
    )
    max_recognize_calls: int = field(
        default=8,
        metadata={
            "help": "most Recognize calls (and HTTP transcriptions) one frontend process serves at once; "
            "beyond it a call waits its turn (first come, first served) within --max-recognize-queue-bytes. "
            "In the engine, recorded work waits for the capacity live calls leave (its share of the queue is "
            "--max-queue-recorded: keep it at least this times --recognize-inflight)"
        },
    )
    max_recognize_queue_bytes: int = field(
        default=256 << 20,
        metadata={
            "help": "audio bytes the Recognize calls (and HTTP transcriptions) waiting past "
            "--max-recognize-calls may hold, one frontend process; a call that would take the queue past it "
            "is refused RESOURCE_EXHAUSTED at once, as batch APIs refuse only a full queue. A waiting call "
            "whose client goes away leaves it (0: no queue, refused at once)"
        },
    )
    max_buffer_seconds: float = field(
        default=120.0,
        metadata={
            "help": "audio a stream may have received but not yet had transcribed (a client sending faster "
            "than real time); beyond it RESOURCE_EXHAUSTED"
        },
    )
    max_audio_lead_seconds: float = field(
        default=120.0,
        metadata={
            "help": "how far a live stream's audio may run ahead of the wall clock since its first audio "
            "(seconds); past it the door stops reading that stream until real time catches up, so the "
            "client's own transport slows it (gRPC and TCP flow control): noise sent faster than real time "
            "costs the VAD no more than a real call. Recorded calls belong in Recognize (0: off)"
        },
    )
    max_response_backlog_bytes: int = field(
        default=1 << 20,
        metadata={
            "help": "responses one stream may have queued for a client that does not read them (bytes, "
            "beyond what HTTP/2 flow control lets through); beyond it the stream's work stops, what is queued "
            "is dropped and the stream ends RESOURCE_EXHAUSTED (the client sees it once it reads again). On "
            "the WebSocket doors, past it the connection is aborted at once and its stream place given back"
        },
    )
    beam_size_final: int = field(
        default=1,
        metadata={
            "help": "beams searched for a live call's final (and its speculative offer, which may become "
            "it): 1 (default) greedy; more trades throughput for accuracy, each beam a KV-cache slot "
            "(docs/benchmarks.md: beam 5 against greedy on this CPU). Interims are always greedy. At most "
            "--max-beam-size; the server refuses to start past it. An asr.v1 call may ask its own "
            "(RecognitionConfig.beam_size)"
        },
    )
    beam_size_recorded: int = field(
        default=1,
        metadata={
            "help": "beams searched for recorded audio (Recognize, HTTP transcriptions): 1 (default) greedy. "
            "The server refuses to start with more than --max-beam-size"
        },
    )
    beam_size_keyterms: int = field(
        default=1,
        metadata={
            "help": "beams searched for a final or a recording whose request lists keyterms, their bonus in "
            "the beams' ranking (--keyterm-beam-bonus): at least this many, whatever --beam-size-final or "
            "--beam-size-recorded say. 1 (default): keyterms decode greedily with the greedy bias; 5 found "
            "more held-out names but cost words on real speech (docs/benchmarks.md Keyterms). Interims are "
            "always greedy. Bounded by --max-beam-size and --kv-slots"
        },
    )
    interim_interval_s: float = field(
        default=1.0,
        metadata={"help": "with interim_results: re-transcribe the partial utterance at most this often"},
    )
    speculative_endpointing: bool = field(
        default=True,
        metadata={
            "help": "start recognizing an utterance as soon as its audio is known (speech pad after its "
            "end), before the silence is long enough to confirm it; the result is sent only once confirmed "
            "and is cancelled if speech resumes: end of speech -> final latency becomes the larger of the "
            "silence wait and the recognition time instead of their sum (finals are identical)"
        },
    )
    turn_model: bool = field(
        # Off by default: on real read speech it cut more mid-sentence pauses than a 1 s silence timeout,
        # and a decision costs ~0.3 s of CPU on this CPU class (docs/benchmarks.md "End of turn").
        default=False,
        metadata={
            "help": "a semantic end of turn for live streams the server endpoints: when the silence reaches "
            "the stream's minimum (Deepgram's endpointing, asr.v1's min_silence_duration), smart-turn v3.2 "
            "judges from the turn's last 8 s whether the speaker is done; a complete turn ends there, an "
            "incomplete one waits for speech to resume, up to --turn-max-silence-s. Off: silence alone ends "
            'turns. Recordings never use it (docs/operations.md "End of turn")'
        },
    )
    turn_threshold: float = field(
        default=0.5,
        metadata={"help": "the turn model's P(turn complete) at or above which a pause ends the turn"},
    )
    turn_max_silence_s: float = field(
        default=2.0,
        metadata={
            "help": "the longest silence a turn the model judged incomplete waits for speech to resume "
            "(seconds); past it the turn ends as silence-only endpointing would end it"
        },
    )
    context_carry: bool = field(
        # Off by default: carried text costs ~28% of CPU throughput at 16 utterances at once (a prompt keeps
        # the encoder's full context) for 3 words of 114 on real speech, and the CPU lead over
        # faster-whisper is a product claim (docs/benchmarks.md "Context across a channel's utterances").
        default=False,
        metadata={
            "help": "condition each utterance of a stream's channel (its finals, interims and speculative "
            "offers) on that channel's earlier finals, as Whisper's long-form decoding does (after the "
            "client's prompt, within the engine's prompt bound; never across channels or calls). A final "
            "that looped (compression ratio over 2.4), was unsure (average log-probability under -1) or "
            "non-speech (no-speech probability over 0.6) is not carried and clears it, and an utterance that "
            "continues speech cut at the endpointing max_utterance_duration gets none. Off by default: it "
            "costs CPU throughput for a few words of WER on real speech (docs/benchmarks.md). asr.v1 streams "
            "may ask for it or refuse it per stream (RecognitionConfig.context_carry); off: each utterance alone"
        },
    )
    context_carry_tokens: int = field(
        default=64,
        metadata={
            "help": "with --context-carry: the most tokens of a channel's earlier text carried into its next "
            "utterance (default 64; older text past it is dropped, the newest kept; the engine keeps fewer "
            "when the client's prompt leaves less of its --max-tokens / 2 - 1 prompt tokens); 0: off"
        },
    )
    vad_gate_db: float = field(
        default=MARGIN_DB,
        metadata={
            "help": "the VAD's noise gate: once the VAD has called 0.5 s of a channel non-speech, windows "
            "within this many dB of that channel's own noise floor are not scored (most of the VAD's CPU on "
            "idle lines and on the silent side of a two-channel call); louder audio always is. 0: every "
            "window scored (docs/operations.md)"
        },
    )
    # --- idle and vanished clients, the RPC bound (docs/operations.md "Idle and vanished clients") ---
    idle_audio_timeout: float = field(
        default=30.0,
        metadata={
            "help": "seconds a stream may go without audio (after its config, or since its last audio) "
            "while not half-closed: what it sent gets its finals, then OUT_OF_RANGE 'Audio Timeout Error' "
            "(as Google Speech answers). A telephone leg sends audio all the time, silence too; 30 s leaves "
            "room for a client's hiccups (0: off)"
        },
    )
    keepalive_time: float = field(
        default=30.0,
        metadata={
            "help": "seconds a connection may be quiet before the server sends it an HTTP/2 keepalive ping; "
            "no answer within --keepalive-timeout closes it and ends its calls (a client whose network died "
            "without a FIN is found within about 50 s instead of gRPC's 2 h)"
        },
    )
    keepalive_timeout: float = field(
        default=20.0,
        metadata={"help": "seconds to wait for the answer to a keepalive ping (gRPC's default)"},
    )
    max_connection_age: float = field(
        default=1800.0,
        metadata={
            "help": "seconds after which a connection is asked (GOAWAY, +-10% jitter) to take its next calls "
            "elsewhere, so long-lived client channels spread over replicas added since; calls in flight "
            "are never cut (the grace is --max-stream-seconds) (0: off)"
        },
    )
    max_concurrent_rpcs: int = field(
        default=0,
        metadata={
            "help": "most RPCs one frontend process runs at once, every method counted (health checks too); "
            "beyond it RESOURCE_EXHAUSTED before the request is read. A backstop for memory: --max-streams "
            "refuses streams first. 0: --max-streams + 128 (one frontend may hold every stream of the "
            "server, with room beside them for Recognize, health and reflection)"
        },
    )
    drain_seconds: float = field(
        default=25.0,
        metadata={
            "help": "on SIGTERM: time for open streams to get their finals before the process exits "
            "(keep below the pod's terminationGracePeriodSeconds)"
        },
    )
    engine_heartbeat_timeout: float = field(
        default=60.0,
        metadata={
            "help": "seconds the engine process's scheduler loop may make no progress while utterances are "
            "pending (or the process publish nothing) before the engine counts as hung: it is killed, health "
            "turns NOT_SERVING, open streams end UNAVAILABLE, the server exits 1. One loop iteration holds one "
            "encoder pass, ~10 s at worst for tiny.en's 16 x 30 s batch on a busy 2-core CPU: 60 s leaves "
            "room for that; raise it for large models on CPU (0: off)"
        },
    )
    frontends: int = field(
        default=0,
        metadata={
            "help": "frontend processes serving the gRPC port (SO_REUSEPORT) and doing all per-stream work "
            "beside the one engine process; 0: max(1, min(usable CPUs - 1, 8)), usable CPUs being the "
            "affinity mask capped by the cgroup CPU quota (one core is left to the engine process)"
        },
    )
    log_level: LogLevel = field(default="info", metadata={"help": "log level"})
    log_format: LogFormat = field(
        default="json", metadata={"help": "json: one JSON object per line; text: for people"}
    )
    log_transcripts: bool = field(
        default=False, metadata={"help": "debug only: put transcript text in the per-utterance log lines"}
    )
    auth_tokens_file: str = field(
        default="",
        metadata={
            "help": "bearer tokens, one per line (# comments), re-read when the file changes; with it (or "
            "ASR_AUTH_TOKENS=tok1,tok2 in the environment) every call needs 'authorization: Bearer <token>'"
        },
    )
    twilio_auth_token_file: str = field(
        default="",
        metadata={
            "help": "Twilio Media Streams door: a file holding the account's auth token (else TWILIO_AUTH_TOKEN "
            "in the environment); with it every stream's X-Twilio-Signature is checked, without it the door "
            "takes bearer tokens as the others do (or anyone, with auth off)"
        },
    )
    twilio_public_url: str = field(
        default="",
        metadata={
            "help": "Twilio Media Streams door: the wss:// URL as Twilio dials it (the TwiML <Stream url>), "
            "which its signature covers; behind a proxy or gateway it is not the URL the server sees "
            "(default: the request's own, with wss:// when TLS is on, else ws://)"
        },
    )
    audiohook_api_key_file: str = field(
        default="",
        metadata={
            "help": "Genesys AudioHook door: a file holding the integration's API key (else AUDIOHOOK_API_KEY "
            "in the environment); with it every session's X-API-KEY must be it, without it the door takes "
            "bearer tokens as the others do"
        },
    )
    audiohook_client_secret_file: str = field(
        default="",
        metadata={
            "help": "Genesys AudioHook door: a file holding the integration's client secret, base64 (else "
            "AUDIOHOOK_CLIENT_SECRET); with it every session's HTTP message signature must verify"
        },
    )
    call_webhook_url: str = field(
        default="",
        metadata={
            "help": "POST every telephony call's messages (call_started, transcript, call_ended) to this URL, "
            "signed with the secret below, retried with backoff; empty: off"
        },
    )
    call_webhook_secret_file: str = field(
        default="",
        metadata={"help": "the call webhook's signing secret, in a file (else CALL_WEBHOOK_SECRET)"},
    )
    call_webhook_queue: int = field(
        default=10000,
        metadata={
            "help": "call webhook messages one frontend keeps waiting while the receiver is slow or down; "
            "past it the oldest is dropped (asr_call_webhook_dropped_total)"
        },
    )
    auth_health_open: bool = field(
        default=True,
        metadata={"help": "with auth on: let health checks through without a token (kubelet probes)"},
    )
    tls_cert: str = field(default="", metadata={"help": "server certificate chain (PEM): serve TLS"})
    tls_key: str = field(default="", metadata={"help": "server private key (PEM), with --tls-cert"})
    tls_client_ca: str = field(
        default="", metadata={"help": "CA (PEM) that signs client certificates: require mutual TLS"}
    )
    debug_profile_dir: str = field(
        default="",
        metadata={
            "hidden": True,  # benchmarks only (scripts/bench_capacity.py --profile): where a frontend's time goes
            "help": "BENCHMARKS ONLY: each frontend writes a cProfile of its event loop thread to "
            "DIR/frontend-N-PID.prof when it exits",
        },
    )
    engine: EngineConfig = field(default_factory=EngineConfig)

    @property
    def keyterm_beams(self) -> int:
        """--beam-size-keyterms within the beams this engine may search (--max-beam-size, --kv-slots)."""
        return min(self.beam_size_keyterms, self.engine.beam_bound[0])


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _on_off(text: str) -> bool:
    value = text.strip().lower()
    if value in ("on", "true", "yes", "1"):
        return True
    if value in ("off", "false", "no", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")


def _add_fields(group: argparse._ArgumentGroup, cls: type, prefix: str) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            continue  # nested config: added as its own group
        kind = hints[f.name]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc,operator]
        kwargs: dict[str, Any] = {
            "dest": prefix + f.name,
            "default": default,
            "help": f.metadata.get("help", "").replace("%", "%%"),  # argparse formats help with %
        }
        if kind is bool:
            kwargs.update(type=_on_off, metavar="on|off")
            kwargs["help"] += f" (default: {'on' if default else 'off'})"
        else:
            if get_origin(kind) is Literal:
                kwargs["choices"] = list(get_args(kind))
                kind = type(kwargs["choices"][0])
            else:
                kwargs["metavar"] = f.name.upper()
            kwargs["type"] = kind
            if "(default" not in kwargs["help"]:
                kwargs["help"] += " (default: %(default)s)"
        if f.metadata.get("hidden"):
            kwargs["help"] = argparse.SUPPRESS  # test seams stay out of --help
        group.add_argument(_flag(f.name), **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asr-server",
        description="Streaming speech recognition (Whisper) over gRPC: asr.v1.Recognizer, health, reflection, "
        "Prometheus metrics.",
    )
    _add_fields(parser.add_argument_group("server"), ServerConfig, "")
    _add_fields(parser.add_argument_group("engine"), EngineConfig, "engine.")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> ServerConfig:
    ns = vars(build_parser().parse_args(argv))
    engine = EngineConfig(**{k.removeprefix("engine."): v for k, v in ns.items() if k.startswith("engine.")})
    config = ServerConfig(**{k: v for k, v in ns.items() if not k.startswith("engine.")}, engine=engine)
    validate(config)
    return config


CALL_WEBHOOK_SECRET_ENV = "CALL_WEBHOOK_SECRET"


def allowed_peers(text: str) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    """--audiosocket-allowed-peers as networks; ValueError naming the entry that is not one."""
    networks = []
    for entry in filter(None, (e.strip() for e in text.split(","))):
        try:
            networks.append(ipaddress.ip_network(entry, strict=False))
        except ValueError as e:
            raise ValueError(f"{entry!r} is not an address or CIDR block ({e})") from e
    return tuple(networks)


def rtp_port_range(text: str) -> tuple[int, int]:
    """--siprec-rtp-ports as (first, last) with room for one even port; ValueError naming what is wrong."""
    first, sep, last = text.partition("-")
    try:
        low, high = int(first), int(last if sep else first)
    except ValueError as e:
        raise ValueError(f"{text!r} is not a range FIRST-LAST such as 20000-20999") from e
    if not 1024 <= low <= high <= 65535 or high - low < 1:
        raise ValueError(f"{text!r}: FIRST < LAST, both within 1024-65535")
    return low, high


def validate(config: ServerConfig) -> None:
    """Refuse settings that cannot work, naming the flag (argparse-style exit via SystemExit)."""
    problems = []
    if not 0 <= config.port <= 65535:
        problems.append("--port must be 0-65535")
    if not 0 <= config.metrics_port <= 65535:
        problems.append("--metrics-port must be 0-65535")
    if not 0 <= config.audiosocket_port <= 65535:
        problems.append("--audiosocket-port must be 0-65535")
    try:
        allowed_peers(config.audiosocket_allowed_peers)
    except ValueError as e:
        problems.append(f"--audiosocket-allowed-peers: {e}")
    if not 0 <= config.siprec_port <= 65535:
        problems.append("--siprec-port must be 0-65535")
    try:
        allowed_peers(config.siprec_allowed_peers)
    except ValueError as e:
        problems.append(f"--siprec-allowed-peers: {e}")
    try:
        rtp_port_range(config.siprec_rtp_ports)
    except ValueError as e:
        problems.append(f"--siprec-rtp-ports: {e}")
    if config.siprec_rtp_timeout < 0:
        problems.append("--siprec-rtp-timeout must be 0 (off) or more")
    if config.siprec_max_message_bytes < 1024:
        problems.append("--siprec-max-message-bytes must be at least 1024")
    if not 0 <= config.http_port <= 65535:
        problems.append("--http-port must be 0-65535")
    for name in (
        "max_streams",
        "max_chunk_bytes",
        "max_recognize_bytes",
        "max_response_backlog_bytes",
        "recognize_inflight",
        "max_recognize_calls",
    ):
        if getattr(config, name) < 1:
            problems.append(f"{_flag(name)} must be at least 1")
    for name in (
        "max_stream_seconds",
        "max_recognize_seconds",
        "max_buffer_seconds",
        "interim_interval_s",
        "http_read_timeout",
    ):
        if getattr(config, name) <= 0:
            problems.append(f"{_flag(name)} must be positive")
    if config.http_min_upload_rate < 0:
        problems.append("--http-min-upload-rate must not be negative (0: off)")
    if not 0 <= config.frontends <= 64:
        problems.append("--frontends must be 0-64 (0: from the CPU count)")
    if config.engine_heartbeat_timeout != 0 and not 1 <= config.engine_heartbeat_timeout <= 3600:
        problems.append("--engine-heartbeat-timeout must be 0 (off) or 1-3600 s")
    if config.idle_audio_timeout < 0:
        problems.append("--idle-audio-timeout must be 0 (off) or positive")
    if not 0 <= config.live_diarization_wait_s <= 60:
        problems.append("--live-diarization-wait-s must be 0-60 s")
    if not 0 < config.turn_threshold < 1:
        problems.append("--turn-threshold must be between 0 and 1 (exclusive)")
    if not 0.1 <= config.turn_max_silence_s <= 10:
        problems.append("--turn-max-silence-s must be 0.1-10 s")
    if not 0 <= config.vad_gate_db <= 20:
        problems.append("--vad-gate-db must be 0 (off) to 20 dB")
    if not 0 <= config.context_carry_tokens <= 223:
        problems.append("--context-carry-tokens must be 0 (off) to 223 (Whisper's prompt bound)")
    for name in ("keepalive_time", "keepalive_timeout"):
        if getattr(config, name) < 1:
            problems.append(f"{_flag(name)} must be at least 1 s")
    if config.max_connection_age != 0 and config.max_connection_age < 1:
        problems.append("--max-connection-age must be 0 (off) or at least 1 s")
    if config.max_concurrent_rpcs < 0:
        problems.append("--max-concurrent-rpcs must be 0 (from --max-streams) or positive")
    if config.drain_seconds < 0:
        problems.append("--drain-seconds must not be negative")
    if bool(config.tls_cert) != bool(config.tls_key):
        problems.append("--tls-cert and --tls-key go together")
    if config.call_webhook_url:
        if not config.call_webhook_url.startswith(("https://", "http://")):
            problems.append("--call-webhook-url must be an http:// or https:// URL")
        if not config.call_webhook_secret_file and not os.environ.get(CALL_WEBHOOK_SECRET_ENV):
            problems.append(
                f"--call-webhook-url needs a signing secret: --call-webhook-secret-file or {CALL_WEBHOOK_SECRET_ENV}"
            )
        if config.call_webhook_queue < 1:
            problems.append("--call-webhook-queue must be at least 1")
    if config.twilio_public_url and not config.twilio_public_url.startswith(("wss://", "ws://")):
        problems.append("--twilio-public-url must be a ws:// or wss:// URL (the TwiML <Stream url>)")
    if config.tls_client_ca and not config.tls_cert:
        problems.append("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS first)")
    for name in (
        "auth_tokens_file",
        "twilio_auth_token_file",
        "audiohook_api_key_file",
        "audiohook_client_secret_file",
        "call_webhook_secret_file",
        "tls_cert",
        "tls_key",
        "tls_client_ca",
    ):
        path = getattr(config, name)
        if path and not os.access(path, os.R_OK):
            problems.append(f"{_flag(name)} {path!r} is not a readable file")
    beams, flag = config.engine.beam_bound
    if not 1 <= config.beam_size_keyterms <= 64:
        problems.append(f"--beam-size-keyterms must be 1-64 (got {config.beam_size_keyterms})")
    for name in ("beam_size_final", "beam_size_recorded"):
        if not 1 <= getattr(config, name) <= beams:
            problems.append(f"{_flag(name)} must be 1-{beams} ({flag} {beams})")
    problems += config.engine.validate()
    if problems:
        message = "asr-server: " + "; ".join(problems)
        print(message, file=sys.stderr)
        raise InvalidConfig(message)


class InvalidConfig(SystemExit):
    """Exit status 2, as argparse's own usage errors; str() keeps the message for callers."""

    def __init__(self, message: str) -> None:
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message
