"""A pod's termination on a real `asr-server` process with streams in flight, in the order Kubernetes
runs it (deploy/README.md, "Drain, probes and disruptions"):

1. preStop pause: the pod is leaving the load balancer, but the server is not signalled yet: it keeps
   serving and keeps accepting the streams a balancer still routes to it;
2. SIGTERM: health NOT_SERVING, new streams refused, open streams told to RECONNECT;
3. drain: every stream, the late one included, gets the finals of what it sent; exit 0.

Run with one frontend process and with two, as the pods run it (a supervisor, one engine process and
--frontends gRPC frontends sharing the port): each stream has its own connection, so the kernel's
SO_REUSEPORT spreads them over the frontends, and every frontend must drain on the one SIGTERM the
kubelet sends to the supervisor."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from asr.v1 import asr_pb2
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients.client import RecognizerClient
from tests.support.audio import make_conversation
from tests.support.server import ServerProcess

pytestmark = pytest.mark.slow
Event = asr_pb2.StreamingRecognizeResponse.SpeechEventType
DRAIN_SECONDS = 20
# Stands in for the pod's preStop sleep (15 s in deploy/k8s): long enough for a stream opened in it
# to be accepted and have speech under way when SIGTERM comes.
PRESTOP_PAUSE_S = 3.0
LATE = 2  # index of the stream a load balancer still sends during the preStop pause
# A channel of its own per client: without it grpc shares one subchannel (one TCP connection, so one
# frontend) between channels to the same target.
OWN_CONNECTION = (("grpc.use_local_subchannel_pool", 1),)


@pytest.mark.parametrize("frontends", [1, 2])
async def test_prestop_pause_then_sigterm_drains_streams_then_exits_zero(frontends: int) -> None:
    audio, bounds = make_conversation(
        [
            "Thank you for calling, how can I help you today?",
            "I would like to check the status of my order.",
            # Keeps the first two streams open past the preStop pause and into the drain: with
            # speculative endpointing their last final is ready the moment their audio ends.
            "It was placed last week and it has not arrived yet.",
        ],
        pause_s=1.0,
    )
    server = ServerProcess(
        "--drain-seconds", str(DRAIN_SECONDS), "--frontends", str(frontends)
    ).wait_serving()
    clients = [RecognizerClient(server.target, options=OWN_CONNECTION) for _ in range(3)]
    try:
        # The refusal below is asked on the first stream's connection: a connection opened after
        # SIGTERM finds the listeners closed (also UNAVAILABLE, but says nothing of the drain).
        async with clients[0] as client:
            received: list[list[asr_pb2.StreamingRecognizeResponse]] = [[], [], []]
            first_final = asyncio.Event()
            begins = [0, 0, 0]
            began = [asyncio.Event(), asyncio.Event(), asyncio.Event()]
            second_sentence = [asyncio.Event(), asyncio.Event(), asyncio.Event()]
            reconnected = [asyncio.Event(), asyncio.Event(), asyncio.Event()]

            async def stream(i: int) -> None:
                async for r in clients[i].stream_file(audio, rate=16000, realtime=True):
                    received[i].append(r)
                    if any(x.is_final for x in r.results):
                        first_final.set()
                    if r.speech_event_type == Event.SPEECH_ACTIVITY_BEGIN:
                        begins[i] += 1
                        began[i].set()
                        if begins[i] == 2:
                            second_sentence[i].set()
                    if r.speech_event_type == Event.RECONNECT:
                        reconnected[i].set()

            # Health is watched from before the pause: once the streams end the process exits, so a
            # health check asked afterwards could only meet a closed port.
            statuses: list[int] = []
            not_serving = asyncio.Event()

            async def watch_health() -> None:
                async with aio.insecure_channel(server.target) as channel:
                    request = health_pb2.HealthCheckRequest(service="asr.v1.Recognizer")
                    try:
                        async for update in health_pb2_grpc.HealthStub(channel).Watch(request):
                            statuses.append(update.status)
                            if update.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                                not_serving.set()
                    except aio.AioRpcError:
                        pass  # the server went away after draining

            watcher = asyncio.create_task(watch_health())
            streams = [asyncio.create_task(stream(i)) for i in range(2)]
            await asyncio.wait_for(first_final.wait(), 30)
            await asyncio.wait_for(asyncio.gather(*(second_sentence[i].wait() for i in range(2))), 30)
            await asyncio.sleep(0.8)  # a few words into it: enough speech to transcribe

            # 1. preStop pause. The kubelet runs the pod's sleep; the server hears nothing yet. A load
            # balancer that has not yet dropped the pod opens one more call: it must be served.
            pause_started = time.monotonic()
            streams.append(asyncio.create_task(stream(LATE)))
            await asyncio.wait_for(began[LATE].wait(), PRESTOP_PAUSE_S)
            assert await asyncio.to_thread(server.health) == "SERVING"
            await asyncio.sleep(max(0.0, PRESTOP_PAUSE_S - (time.monotonic() - pause_started)))
            assert not not_serving.is_set() and not any(t.done() for t in streams), server.log()[-3000:]
            assert set(statuses) == {health_pb2.HealthCheckResponse.SERVING}

            # 2. SIGTERM, as the kubelet sends it once preStop returns. The first sentence's finals
            # are in; the second sentence (the late stream's first) is being spoken right now.
            terminated_at = time.monotonic()
            server.terminate()

            # While draining: new streams on an open connection are refused, health says NOT_SERVING.
            # Asked at once, while the streams still hold the drain open (once they end the frontend
            # stops, and a late attempt would only meet a closed port). The supervisor relays the
            # signal to the frontends: first wait until the one holding this connection has heard it
            # (its health, on the same connection), or the attempt may be accepted just before.
            for _ in range(100):
                if await client.health() == "NOT_SERVING":
                    break
                await asyncio.sleep(0.05)
            refused: aio.AioRpcError | None = None
            for _ in range(40):
                try:
                    async for _response in client.stream_file(audio[:16000], rate=16000):
                        pass
                except aio.AioRpcError as error:
                    refused = error
                    break
                await asyncio.sleep(0.05)
            assert refused is not None, "no stream was refused during the drain"
            assert refused.code() == grpc.StatusCode.UNAVAILABLE, server.log()[-3000:]
            assert "draining" in (refused.details() or ""), server.log()[-3000:]
            await asyncio.wait_for(not_serving.wait(), 10)
            assert statuses[0] == health_pb2.HealthCheckResponse.SERVING
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in reconnected)), 10)

            # 3. Drain: every stream, the late one too, ends with OK.
            await asyncio.wait_for(asyncio.gather(*streams), DRAIN_SECONDS)
            watcher.cancel()
        code = await asyncio.to_thread(server.wait, DRAIN_SECONDS + 10)
        assert code == 0, server.log()
        assert time.monotonic() - terminated_at < DRAIN_SECONDS + 5
    finally:
        for c in clients:
            await c.close()
        server.stop()

    # No final lost: every utterance that ended got its final, and the one cut short by the drain too.
    for i, responses in enumerate(received):
        finals = [r for x in responses for r in x.results if r.is_final]
        ended = [x for x in responses if x.speech_event_type == Event.SPEECH_ACTIVITY_END]
        began_count = sum(x.speech_event_type == Event.SPEECH_ACTIVITY_BEGIN for x in responses)
        assert len(finals) >= max(len(ended), began_count), f"stream {i}: a final was lost"
        assert [f.utterance_index for f in finals] == list(range(len(finals))), f"stream {i}"
        assert "thank you" in finals[0].alternatives[0].transcript.lower(), f"stream {i}"
        kinds = [x.speech_event_type for x in responses]
        assert kinds.count(Event.RECONNECT) == 1, f"stream {i}"
        if i != LATE:
            assert len(finals) >= 2
            assert finals[1].start_offset.ToTimedelta().total_seconds() == pytest.approx(
                bounds[1][0], abs=0.3
            )
