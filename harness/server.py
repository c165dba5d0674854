"""`asr-server` as a subprocess on loopback, for tests and benchmark scripts: one implementation of
start (free ports), wait for SERVING, scrape /metrics, stop (SIGTERM, wait, kill), and the same for
the code of an older git ref (`git archive` into a folder whose tree runs instead of this checkout's).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from harness.metrics import Metrics, scrape
from service.runtime.ports import LOOPBACK, free_port

__all__ = [
    "HOST",
    "REPO",
    "ServerProcess",
    "checkout",
    "end_process",
    "merge_base",
    "short_commit",
    "source_tree",
    "split_server_args",
]
HOST = LOOPBACK  # servers under test or benchmark never listen beyond this machine
REPO = Path(__file__).resolve().parents[1]


def supervisor_module(tree: Path) -> str:
    """The module asr-server's console script runs, in `tree` (older refs kept it at the top of service/)."""
    return (
        "service.runtime.supervisor"
        if (tree / "service/runtime/supervisor.py").exists()
        else "service.supervisor"
    )


def source_tree(ref: str, into: Path, paths: Sequence[str] = ()) -> Path:
    """The files of git `ref` (all, or only `paths`) extracted into `into`, without .git."""
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "archive", ref, *paths], cwd=REPO, check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


@contextlib.contextmanager
def checkout(ref: str, paths: Sequence[str] = ()) -> Iterator[Path]:
    """`source_tree(ref)` in a temporary folder, removed afterwards."""
    tmp = Path(tempfile.mkdtemp(prefix="asr-ref-"))
    try:
        yield source_tree(ref, tmp / "src", paths)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def split_server_args(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """A script's own arguments and, after a `--`, the flags it passes to every server it starts."""
    if "--" not in argv:
        return list(argv), []
    cut = list(argv).index("--")
    return list(argv[:cut]), list(argv[cut + 1 :])


def short_commit() -> str:
    """This checkout's HEAD, abbreviated: the commit a benchmark's figures come from."""
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return out.stdout.strip()


def merge_base(branch: str = "main") -> str:
    """Where this checkout's HEAD left `branch`: the default "before" of a before/after benchmark."""
    out = subprocess.run(
        ["git", "merge-base", "HEAD", branch], cwd=REPO, check=True, capture_output=True, text=True
    )
    return out.stdout.strip()


def end_process(proc: subprocess.Popen[bytes], grace_s: float) -> int:
    """SIGTERM and up to `grace_s` seconds to exit (0: none), then SIGKILL; the exit status."""
    if proc.poll() is None and grace_s > 0:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace_s)
    if proc.poll() is None:
        proc.kill()
    return proc.wait(10)


def health_status(target: str, service: str = "asr.v1.Recognizer") -> str:
    """The health service's answer for `service` at `target` ("SERVING", "NOT_SERVING", ...)."""
    with grpc.insecure_channel(target) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=2
        )
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


class ServerProcess:
    """`asr-server` in a subprocess on 127.0.0.1 with free ports, its output in a log file (`log()`).

    - `args` go last, so they override the defaults (`--threads 2 --log-format json`; `threads=None`
      leaves the server's own thread count). The HTTP door is off unless `http` (then on a free port:
      never the default 8000, which parallel servers would share).
    - `ports_of` takes another server's ports (a restart); `own_process_group` puts it in a process
      group of its own, which a caller may signal as a whole (systemd's KillMode=control-group).
    - `source`: a source tree (`source_tree()`, `checkout()`) whose service and engine run instead of
      this checkout's, on this interpreter's packages (the generated asr.v1 protos included).
    - `log_path`: where the output goes and stays (default: a temporary file `stop()` removes).

    As a context manager: `stop(grace_s=60)` on leaving (SIGTERM, the server drains, then kill).
    """

    port: int
    metrics_port: int
    http_port: int  # 0: the HTTP door is off

    def __init__(
        self,
        *args: str,
        env: dict[str, str] | None = None,
        http: bool = False,
        ports_of: ServerProcess | None = None,
        own_process_group: bool = False,
        threads: int | None = 2,
        log_format: str = "json",
        source: Path | None = None,
        log_path: Path | None = None,
    ) -> None:
        if ports_of is not None:
            self.port, self.metrics_port, self.http_port = (
                ports_of.port,
                ports_of.metrics_port,
                ports_of.http_port,
            )
        else:
            self.port, self.metrics_port = free_port(), free_port()
            self.http_port = free_port() if http else 0
        self.source = source
        self._own_log = log_path is None
        if log_path is None:
            with tempfile.NamedTemporaryFile(prefix="asr-server-", suffix=".log", delete=False) as f:
                log_path = Path(f.name)
        self.log_path = log_path
        environ = {**os.environ, **(env or {})}
        if source is None:
            exe = Path(sys.executable).with_name("asr-server")
            command = [str(exe)] if exe.exists() else [sys.executable, "-m", "service.runtime.supervisor"]
            cwd = REPO
        else:
            # `-m` from the tree, the tree first on the path of every process the supervisor starts
            command, cwd = [sys.executable, "-m", supervisor_module(source)], source
            environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(source), environ.get("PYTHONPATH")]))
        argv = [
            *command,
            *("--host", HOST, "--port", str(self.port), "--metrics-port", str(self.metrics_port)),
            *("--http-port", str(self.http_port), "--log-format", log_format),
            *(("--threads", str(threads)) if threads is not None else ()),
            *args,
        ]
        self.argv = argv
        with log_path.open("wb") as log:  # the child holds its own descriptor
            self.proc = subprocess.Popen(
                argv,
                cwd=cwd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=environ,
                process_group=0 if own_process_group else None,
            )

    @property
    def target(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def http_url(self) -> str:
        return f"http://{HOST}:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{HOST}:{self.metrics_port}/metrics"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def health(self, service: str = "asr.v1.Recognizer") -> str:
        return health_status(self.target, service)

    def wait_serving(self, timeout: float = 180) -> ServerProcess:
        """Until the server reports SERVING; raises at once if it exits, with its log."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"asr-server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if self.health() == "SERVING":
                    return self
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"asr-server not SERVING after {timeout} s:\n{self.log()}")

    def metrics(self, timeout: float = 10.0) -> Metrics:
        return scrape(self.metrics_url, timeout)

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def stop(self, grace_s: float = 0.0) -> int | None:
        """End the server: SIGTERM and up to `grace_s` seconds to drain and exit (0: none), then
        SIGKILL; removes a temporary log. Returns its exit status."""
        code = end_process(self.proc, grace_s)
        if self._own_log:
            self.log_path.unlink(missing_ok=True)
        return code

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop(grace_s=60)
