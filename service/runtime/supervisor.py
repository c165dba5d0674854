"""asr-server's process model: a supervisor, one engine process, N frontend processes.

                 ┌──────────────── supervisor (signals, /metrics, restarts) ───────────────┐
  gRPC :50051 ──►│ frontend-0 ─┐                                                          │
  (SO_REUSEPORT) │ frontend-1 ─┼── ZeroMQ (ipc://, audio as raw float32) ──► engine process │
                 │ frontend-N ─┘   per-stream work: gRPC, decoding,          model, scheduler,│
                 │                 resampling, VAD, results                  KV cache, device │
                 └──────────────────────────────────────────────────────────────────────────┘

Why processes: one interpreter lock shared by gRPC, per-chunk audio work and the scheduler loop is
the ceiling (issue 12); frontends scale across cores and the scheduler keeps its own interpreter.

- Children are started with 'spawn' (torch + threads + fork is unsafe) and die with the supervisor
  (PR_SET_PDEATHSIG), however it ends: no orphan survives a SIGKILL of the supervisor.
- The engine process and the frontends start together (a frontend's imports take seconds, like the
  model's load); frontends open their ports only once the model is loaded and warm.
- The engine process dies: each frontend sees its socket close, reports NOT_SERVING, ends its open
  streams UNAVAILABLE and exits; the supervisor exits 1 (the pod restarts; no model, no service).
- The engine process hangs without dying (a stuck device call, a deadlocked scheduler thread): it
  publishes a heartbeat into shared memory (engine/process/core_process.py); when its scheduler loop makes no
  progress for --engine-heartbeat-timeout with utterances pending, or it publishes nothing at all for
  that long, the supervisor kills it (SIGKILL: a hung process may not heed SIGTERM) and the death path
  above follows: NOT_SERVING, open streams UNAVAILABLE, exit 1.
- A frontend dies: the others keep serving and the supervisor starts a new one in its place (a
  frontend holds no model: it is back in about a second), unless frontends keep dying (more than
  MAX_RESTARTS within RESTART_WINDOW_S), which is a bug a restart will not fix: then it exits 1.
- --max-streams is the server's: the frontends count their streams in shared memory the supervisor
  creates, which gives a dead frontend's places back (service/recognizer/stream_limit.py).
- SIGTERM/SIGINT: every frontend drains (health NOT_SERVING, open streams get their finals) while the
  engine keeps serving them; then the engine stops; exit 0 within --drain-seconds. The supervisor alone
  orders this, whoever got the signal: children ignore SIGTERM and SIGINT (systemd's KillMode=
  control-group, `kill -- -PGID` and a terminal's Ctrl-C reach every process at once) and heed only
  CONTROL_SIGNAL, which only the supervisor sends (a frontend drains, the engine stops). They start with
  SIGTERM and SIGINT blocked, so one that reaches the group while a child starts is discarded, not fatal.
- /metrics: prometheus-client's multiprocess mode (each process writes its own values to a fresh
  directory; the supervisor serves their combination). Chosen over the supervisor gathering values
  over IPC: every existing metric keeps its name, type and meaning with no code at the call sites,
  and a process's counters survive its death until the next restart of the server. Gauges state
  how they combine (multiprocess_mode). Per-process CPU and memory come from /proc at scrape time
  as process_cpu_seconds_total / process_resident_memory_bytes with a `process` label.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, MutableSequence, Sequence
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event as EventType
from pathlib import Path

import prometheus_client
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.api import EngineConfig
from engine.process.core_process import (
    HEARTBEAT_PENDING,
    HEARTBEAT_PROGRESS,
    HEARTBEAT_PUBLISHED,
    HEARTBEAT_SLOTS,
)
from engine.process.cpus import usable_cpus
from service.config import ServerConfig
from service.recognizer.call_hub import CallHubForwarder, HubAddresses, ZmqCallHub
from service.recognizer.stream_limit import SharedStreamCounts, SharedStreamLimit, caller_buckets
from service.runtime.exits import EXIT_ENGINE_FAILED, EXIT_LOAD_FAILED, EXIT_OK
from service.runtime.logging import setup_logging

log = logging.getLogger("service.runtime.supervisor")

MAX_RESTARTS, RESTART_WINDOW_S = 5, 60.0
_PR_SET_PDEATHSIG = 1
# The supervisor's word to its children: a frontend drains, the engine process stops. Signals from
# outside (to the whole process group or cgroup) are for the supervisor only.
CONTROL_SIGNAL = signal.SIGUSR1
OUTSIDE_SIGNALS = {signal.SIGTERM, signal.SIGINT}


# --- how many frontends ---


def default_frontends(cpus: int | None = None) -> int:
    """One core for the engine process, the rest for frontends, at least one and at most 8."""
    return max(1, min((usable_cpus() if cpus is None else cpus) - 1, 8))


# --- the port ---


def reserve_port(host: str, port: int) -> socket.socket:
    """Check that no live server has (host, port), then hold it for this one; port 0 picks a free port.

    The probe binds with SO_REUSEADDR and without SO_REUSEPORT. On Linux that bind succeeds over
    sockets that are only closing (TIME_WAIT, FIN_WAIT2: a previous server's connections, kept for up
    to a minute after it stopped or was killed, e.g. towards a keep-alive client that never reads), so
    a restart serves at once; it fails on a listening socket, and on another server's holder (bound
    without SO_REUSEADDR), so two live servers never share the port. The holder is an SO_REUSEPORT
    socket that never listens, held while this server runs: frontends bind the same port with
    SO_REUSEPORT (only listening sockets take connections), and a second server's probe fails on it,
    also while this one is still loading its model."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    with socket.socket(family, kind, proto) as probe:
        if family == socket.AF_INET6:
            probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(address)
        port = probe.getsockname()[1]
    holder = socket.socket(family, kind, proto)
    if family == socket.AF_INET6:
        holder.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    # no SO_REUSEADDR here: it would let a second server's probe bind over this holder
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    holder.bind((address[0], port, *address[2:]))
    return holder


# --- children ---


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when the supervisor ends, however it ends (Linux PR_SET_PDEATHSIG); heed
    SIGTERM and SIGINT from outside no more (they were blocked since the start: see start_child)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:  # the supervisor died before prctl took effect
        os._exit(EXIT_ENGINE_FAILED)
    for sig in OUTSIDE_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)  # discards one already pending
    signal.pthread_sigmask(signal.SIG_UNBLOCK, OUTSIDE_SIGNALS)


def start_child(p: BaseProcess) -> None:
    """Start a child with SIGTERM and SIGINT blocked (a spawned child inherits the mask): one sent to
    the whole group while it starts waits until the child ignores it, instead of killing it."""
    # Started first: starting it unblocks these signals in this process (as it protects itself the same
    # way), which would undo the mask below for the child started on the way.
    resource_tracker.ensure_running()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, OUTSIDE_SIGNALS)
    try:
        p.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def tell_to_stop(p: BaseProcess) -> None:
    """A frontend drains, the engine process stops (what SIGTERM is to the supervisor)."""
    if p.pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, CONTROL_SIGNAL)


def engine_main(
    config: EngineConfig,
    address: str,
    ready: Connection,
    parent_pid: int,
    log_level: str,
    log_format: str,
    heartbeat: MutableSequence[float] | None = None,
) -> None:
    """The engine process (see engine/process/core_process.py); stops on CONTROL_SIGNAL."""
    _die_with_parent(parent_pid)
    setup_logging(log_level, log_format)
    from engine.process.core_process import serve

    sys.exit(serve(config, address, ready, heartbeat, stop_signal=CONTROL_SIGNAL))


def frontend_main(
    index: int,
    config: ServerConfig,
    address: str,
    parent_pid: int,
    streams: SharedStreamCounts,
    hub: HubAddresses,
    engine_ready: EventType,
) -> None:
    """A frontend process: gRPC server on the shared port, its engine an EngineClient; drains on
    CONTROL_SIGNAL. Started beside the engine process: it imports its doors while the model loads
    (seconds of every start), then waits for the engine to be ready."""
    _die_with_parent(parent_pid)
    setup_logging(config.log_level, config.log_format)
    import service.runtime.server  # noqa: F401  (the frontend's imports, while the engine loads)

    engine_ready.wait()
    if config.debug_profile_dir:  # benchmarks: where a frontend's time goes (its event loop thread)
        import cProfile

        profiler = cProfile.Profile()
        code = profiler.runcall(asyncio.run, _serve_frontend(index, config, address, streams, hub))
        profiler.dump_stats(Path(config.debug_profile_dir) / f"frontend-{index}-{os.getpid()}.prof")
        sys.exit(code)
    sys.exit(asyncio.run(_serve_frontend(index, config, address, streams, hub)))


async def _serve_frontend(
    index: int, config: ServerConfig, address: str, streams: SharedStreamCounts, hub: HubAddresses
) -> int:
    # Here, in the frontend process only: the supervisor holds no server (nor the service's metrics,
    # whose gauges would then count the supervisor as a frontend).
    from engine.process.client import EngineClient
    from service.runtime.server import AsrServer, init_metrics

    init_metrics()
    try:
        # the pid keeps a restarted frontend's identity and request ids apart from its predecessor's
        client = await asyncio.to_thread(EngineClient, address, name=f"frontend-{index}-{os.getpid()}")
    except Exception as e:
        log.error(f"frontend-{index} could not reach the engine process: {e!r}")
        return EXIT_ENGINE_FAILED
    limit = SharedStreamLimit(config.max_streams, streams, index, config.max_streams_per_token)
    server = AsrServer(config, client, reuse_port=True, stream_limit=limit, call_hub=ZmqCallHub(hub))
    asyncio.get_running_loop().add_signal_handler(CONTROL_SIGNAL, server.request_shutdown)
    return await server.run()


# --- /metrics ---


class ProcessTreeCollector(Collector):
    """CPU seconds and resident memory of every process of the server, labelled by its role."""

    def __init__(self, processes: Callable[[], dict[str, int]]) -> None:
        self._processes = processes
        self._tick = os.sysconf("SC_CLK_TCK")
        self._page = os.sysconf("SC_PAGE_SIZE")

    def collect(self) -> Iterator[Metric]:
        cpu = CounterMetricFamily(
            "process_cpu_seconds", "User and system CPU time of each server process", labels=["process"]
        )
        rss = GaugeMetricFamily(
            "process_resident_memory_bytes", "Resident memory of each server process", labels=["process"]
        )
        for name, pid in self._processes().items():
            try:
                # fields after the command name (which may hold spaces): utime=11, stime=12, rss=21
                stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue  # it just exited
            cpu.add_metric([name], (int(stat[11]) + int(stat[12])) / self._tick)
            rss.add_metric([name], int(stat[21]) * self._page)
        yield cpu
        yield rss


def metrics_registry(
    metrics_dir: Path, processes: Callable[[], dict[str, int]]
) -> prometheus_client.CollectorRegistry:
    from prometheus_client import multiprocess

    registry = prometheus_client.CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(metrics_dir))
    registry.register(ProcessTreeCollector(processes))
    return registry


# --- the supervisor ---


class HeartbeatWatch:
    """Tells a hung engine process from a slow one, from what it publishes (engine/process/core_process.py):
    hung when its scheduler loop made no progress for `timeout_s` while utterances were pending (the
    clock starts at the later of the last progress and the moment work became pending: an idle loop
    owes no progress), or when it published nothing for `timeout_s` (the whole process is stuck)."""

    def __init__(self, timeout_s: float, now: float) -> None:
        self.timeout_s = timeout_s
        self._progress = -1.0
        self._progress_at = now
        self._pending_since: float | None = None

    def check(self, published: float, progress: float, pending: float, now: float) -> str | None:
        """None while the engine is alive; else why it counts as hung."""
        if progress != self._progress:
            self._progress, self._progress_at = progress, now
        if pending > 0:
            if self._pending_since is None:
                self._pending_since = now
        else:
            self._pending_since = None
        if published and now - published > self.timeout_s:
            return f"the engine process published no heartbeat for {now - published:.0f} s"
        if self._pending_since is not None:
            stalled = now - max(self._progress_at, self._pending_since)
            if stalled > self.timeout_s:
                return (
                    f"the engine's scheduler made no progress for {stalled:.0f} s "
                    f"with {pending:.0f} utterances pending"
                )
        return None


class Supervisor:
    def __init__(self, config: ServerConfig, workdir: Path) -> None:
        self.config = config
        self.frontend_count = config.frontends or default_frontends()
        self.metrics_dir = workdir / "metrics"
        self.address = f"ipc://{workdir / 'engine.sock'}"
        # telephony calls' transcripts to subscribers on any frontend (service/recognizer/call_hub.py)
        self.hub = HubAddresses(f"ipc://{workdir / 'calls-in.sock'}", f"ipc://{workdir / 'calls-out.sock'}")
        self.ctx = multiprocessing.get_context("spawn")
        self.engine: BaseProcess | None = None
        self.frontends: dict[int, BaseProcess] = {}
        self.restarts: list[float] = []
        self.stop_signal: int | None = None
        # written by the engine process only (lock-free: a torn read costs one check, 0.1 s later)
        self.heartbeat = self.ctx.Array("d", HEARTBEAT_SLOTS, lock=False)
        self.engine_ready = self.ctx.Event()  # frontends start beside the engine and wait for this
        # --max-streams for the whole server: each frontend's open streams (service/recognizer/stream_limit.py)
        lock_path = workdir / "streams.lock"
        lock_path.touch(mode=0o600)
        buckets = caller_buckets(config.max_streams)  # --max-streams-per-token's table
        self.streams = SharedStreamCounts(
            self.ctx.Array("i", self.frontend_count, lock=False),
            str(lock_path),
            self.ctx.Array("q", buckets, lock=False),
            self.ctx.Array("i", self.frontend_count * buckets, lock=False),
        )

    def processes(self) -> dict[str, int]:
        out = {"supervisor": os.getpid()}
        if self.engine is not None and self.engine.pid is not None:
            out["engine"] = self.engine.pid
        for i, p in self.frontends.items():
            if p.pid is not None:
                out[f"frontend-{i}"] = p.pid
        return out

    def _on_signal(self, signum: int, frame: object) -> None:
        self.stop_signal = signum

    def _reaped(self, p: BaseProcess) -> None:
        from prometheus_client import multiprocess

        if p.pid is not None:
            multiprocess.mark_process_dead(p.pid, str(self.metrics_dir))

    def _start_frontend(self, index: int) -> None:
        p = self.ctx.Process(
            target=frontend_main,
            args=(index, self.config, self.address, os.getpid(), self.streams, self.hub, self.engine_ready),
            name=f"asr-frontend-{index}",
        )
        start_child(p)
        self.frontends[index] = p

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        c = self.config
        try:
            holder = reserve_port(c.host, c.port)
        except OSError as e:
            log.error(f"could not start the gRPC server: {c.host}:{c.port} is not free: {e}")
            return EXIT_LOAD_FAILED
        with contextlib.ExitStack() as held:
            held.enter_context(holder)
            c.port = holder.getsockname()[1]
            # the doors every frontend serves on one port too (SO_REUSEPORT): the HTTP port, Asterisk's
            # AudioSocket, SIPREC (the kernel hashes a peer's datagrams to one frontend, so a dialog stays
            # on one); each reserved here, so that port 0 picks one port for every frontend
            for door, host_field, port_field in (
                ("the HTTP server", "host", "http_port"),
                ("the AudioSocket door", "audiosocket_host", "audiosocket_port"),
                ("the SIPREC door", "siprec_host", "siprec_port"),
            ):
                host, port = getattr(c, host_field), getattr(c, port_field)
                if not port:
                    continue
                try:
                    door_holder = reserve_port(host, port)
                except OSError as e:
                    log.error(f"could not start {door}: {host}:{port} is not free: {e}")
                    return EXIT_LOAD_FAILED
                held.enter_context(door_holder)
                setattr(c, port_field, door_holder.getsockname()[1])
            held.callback(CallHubForwarder(self.hub).close)
            try:
                return self._run()
            finally:
                self._stop_all(grace=0)

    def _run(self) -> int:
        c = self.config
        ready, child_end = self.ctx.Pipe(duplex=False)
        self.engine = self.ctx.Process(
            target=engine_main,
            args=(c.engine, self.address, child_end, os.getpid(), c.log_level, c.log_format, self.heartbeat),
            name="asr-engine",
        )
        start_child(self.engine)
        child_end.close()
        for i in range(self.frontend_count):
            self._start_frontend(i)
        message = None
        while message is None:
            if self.stop_signal is not None:  # told to stop while loading: nothing is open yet
                self._end_waiting_frontends()
                return EXIT_OK
            waited = multiprocessing.connection.wait([ready, self.engine.sentinel], timeout=0.1)
            if ready in waited:
                try:
                    message = ready.recv()
                except EOFError:
                    message = ("failed", f"the engine process exited with {self.engine.exitcode}")
            elif self.engine.sentinel in waited:
                message = ("failed", f"the engine process exited with {self.engine.exitcode}")
        if message[0] != "ready":
            log.error(
                f"could not load model {c.engine.model!r}: {message[1]}",
                extra={"fields": {"model": c.engine.model, "error": message[1]}},
            )
            self._end_waiting_frontends()
            return EXIT_LOAD_FAILED
        info, load_s = message[1], message[2]
        log.info(
            "engine process ready",
            extra={
                "fields": {
                    "model": info.name,
                    "device": info.device,
                    "pid": self.engine.pid,
                    "load_s": round(load_s, 2),
                    "frontends": self.frontend_count,
                }
            },
        )
        self.engine_ready.set()
        return self._watch()

    def _end_waiting_frontends(self) -> None:
        """The engine never became ready: the frontends waiting for it have nothing open to drain."""
        for p in self.frontends.values():
            p.kill()
            p.join(5)
            self._reaped(p)
        self.frontends.clear()

    def _watch(self) -> int:
        assert self.engine is not None
        timeout = self.config.engine_heartbeat_timeout
        heartbeat = HeartbeatWatch(timeout, time.monotonic()) if timeout else None
        while True:
            waited = multiprocessing.connection.wait(
                [self.engine.sentinel, *(p.sentinel for p in self.frontends.values())], timeout=0.1
            )
            if self.stop_signal is not None:
                return self._drain()
            hung = heartbeat and heartbeat.check(
                self.heartbeat[HEARTBEAT_PUBLISHED],
                self.heartbeat[HEARTBEAT_PROGRESS],
                self.heartbeat[HEARTBEAT_PENDING],
                time.monotonic(),
            )
            if hung and self.engine.is_alive():
                log.critical(
                    f"engine process hung: {hung} (--engine-heartbeat-timeout {timeout:g}); killing it",
                    extra={"fields": {"pid": self.engine.pid}},
                )
                self.engine.kill()  # its death takes the path below: frontends fail their streams
                self.engine.join(10)
            if self.engine.sentinel in waited or not self.engine.is_alive():
                log.critical(
                    "engine process exited; exiting", extra={"fields": {"exitcode": self.engine.exitcode}}
                )
                self._reaped(self.engine)
                # the frontends have seen its socket close: they fail their streams UNAVAILABLE and exit
                self._stop_all(grace=5.0)
                return EXIT_ENGINE_FAILED
            for i, p in list(self.frontends.items()):
                if p.is_alive():
                    continue
                p.join()
                self._reaped(p)
                self.streams.clear(i)  # its streams died with it: their places are free
                now = time.monotonic()
                self.restarts = [t for t in self.restarts if now - t < RESTART_WINDOW_S] + [now]
                if len(self.restarts) > MAX_RESTARTS:
                    log.critical(
                        f"frontend-{i} exited with {p.exitcode}; frontends keep dying "
                        f"({len(self.restarts)} in {RESTART_WINDOW_S:.0f} s): exiting"
                    )
                    self._stop_all(grace=5.0)
                    return EXIT_ENGINE_FAILED
                log.error(f"frontend-{i} exited with {p.exitcode}; starting a new one")
                self._start_frontend(i)

    def _drain(self) -> int:
        """Frontends drain (each gives its open streams their finals within --drain-seconds) while the
        engine still serves them; then the engine stops."""
        log.info(
            "draining",
            extra={"fields": {"signal": self.stop_signal, "drain_seconds": self.config.drain_seconds}},
        )
        for p in self.frontends.values():
            tell_to_stop(p)
        deadline = time.monotonic() + self.config.drain_seconds + 1.0
        for p in self.frontends.values():
            p.join(max(0.0, deadline - time.monotonic()))
        # a frontend still starting when told ends by the signal's default action: it had nothing open
        failed = [p.exitcode for p in self.frontends.values() if p.exitcode not in (0, None, -CONTROL_SIGNAL)]
        self._stop_all(grace=5.0)
        return EXIT_ENGINE_FAILED if failed else EXIT_OK

    def _stop_all(self, grace: float) -> None:
        """Tell what still runs to stop, frontends first, then SIGKILL what outlives `grace`."""
        children = [*self.frontends.values(), *([self.engine] if self.engine is not None else [])]
        for p in children:
            if p.is_alive():
                tell_to_stop(p)
                p.join(grace)
            if p.is_alive():
                log.warning(f"{p.name} did not stop; killing it")
                p.kill()
                p.join(5)
            self._reaped(p)


def preflight_model(config: EngineConfig) -> None:
    """Refuse a --model that names no loadable folder before any port opens: a typo'd path must not
    leave a half-started server behind (the full load, which can fail later, runs behind NOT_SERVING)."""
    from engine.model.weights import (
        BUNDLED,
        ModelLoadError,
        default_cache_dir,
        is_ct2_whisper,
        is_hf_whisper,
        resolve,
    )

    if config.model in BUNDLED:
        return
    folder, _ = resolve(config.model, Path(config.cache_dir) if config.cache_dir else default_cache_dir())
    if not (is_hf_whisper(folder) or is_ct2_whisper(folder)):
        raise ModelLoadError(
            f"--model {config.model!r}: {folder} is neither a Hugging Face Whisper folder (config.json with "
            "model_type 'whisper') nor a CTranslate2 Whisper folder (model.bin + tokenizer.json)"
        )


def run(config: ServerConfig) -> int:
    """asr-server's whole life as a supervisor of its processes; returns the exit code."""
    workdir = Path(tempfile.mkdtemp(prefix="asr-server-"))  # 0700: the IPC socket and metric files
    metrics_dir = workdir / "metrics"
    metrics_dir.mkdir()
    # Read by prometheus-client as each child imports it (spawn starts them with this environment).
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
    supervisor = Supervisor(config, workdir)
    try:
        if config.metrics_port:
            registry = metrics_registry(metrics_dir, supervisor.processes)
            host = (config.metrics_host or config.host).strip("[]")
            try:
                prometheus_client.start_http_server(config.metrics_port, addr=host or "::", registry=registry)
            except OSError as e:
                log.error(f"could not start the metrics server on port {config.metrics_port}: {e}")
                return EXIT_LOAD_FAILED
            log.info("metrics at /metrics", extra={"fields": {"port": config.metrics_port}})
        return supervisor.run()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> None:
    """`asr-server`. This module is the console script's entry point so that the children that 'spawn'
    starts (which import the parent's main module again) import no more than it: not the service's
    metrics, whose gauges an engine process must not hold."""
    # torch's OpenMP threads share the cores with the event loops, gRPC and VAD: spinning workers
    # starve them (a tiny.en decode step went 24 -> 125 ms on a busy 2-core box). Set before any
    # process loads torch (children inherit it); an operator's own setting wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from service.config import parse_args

    config = parse_args(argv)
    setup_logging(config.log_level, config.log_format)
    try:
        preflight_model(config.engine)
    except Exception as e:
        log.error(
            f"could not load model {config.engine.model!r}: {e}",
            extra={"fields": {"model": config.engine.model}},
        )
        sys.exit(EXIT_LOAD_FAILED)
    sys.exit(run(config))


if __name__ == "__main__":  # `python -m service.runtime.supervisor` where no console script is installed
    main()
