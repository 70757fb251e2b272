"""gRPC as a hostile or careless local client uses it, against the real daemon: idle streams
over TCP cannot lock out the Unix socket, a stream whose client never reads cannot make the
daemon run (and hold the answers of) its requests without bound, an idle stream is ended."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest
import tritonclient.grpc as tg
from tritonclient.grpc import service_pb2

from edged.serving.grpc_server import STREAM_IN_FLIGHT
from tests.support.daemon_harness import Daemon, cls_input, cls_table, grpc_port, write_config

pytestmark = pytest.mark.integration

STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"
STATS = "/inference.GRPCInferenceService/ModelStatistics"


@pytest.fixture(scope="module")
def daemon(models_dir: Path, tmp_path_factory) -> Daemon:
    folder = tmp_path_factory.mktemp("grpc-hostile")
    models = cls_table(models_dir, max_batch_size=1, max_queue_size=64)
    d = Daemon(write_config(folder, models, "grpc_idle_timeout_s = 2")).wait_ready()
    yield d
    assert d.stop() == 0, d.log_text()


def infer_request(seed: int = 0) -> bytes:
    x = cls_input(seed)
    request = service_pb2.ModelInferRequest(model_name="cls")
    tensor = request.inputs.add(name="x", datatype="FP32")
    tensor.shape.extend(x.shape)
    request.raw_input_contents.append(x.tobytes())
    return request.SerializeToString()


def raw_stream(channel: grpc.aio.Channel):
    return channel.stream_stream(STREAM)  # bytes in, bytes out: no (de)serializers


async def inference_count(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        raw = await channel.unary_unary(STATS)(
            service_pb2.ModelStatisticsRequest(name="cls").SerializeToString()
        )
    stats = service_pb2.ModelStatisticsResponse.FromString(raw)
    return stats.model_stats[0].inference_count


def test_idle_tcp_streams_do_not_lock_out_the_unix_socket(daemon: Daemon) -> None:
    """100 idle streams over TCP (more than the TCP budget of 64 RPCs): health checks on the
    Unix socket still answer; before, one budget for both answered RESOURCE_EXHAUSTED."""
    address = f"127.0.0.1:{grpc_port(daemon)}"
    unix = daemon.config.parent / "grpc.sock"

    async def scenario() -> tuple[bool, list[str]]:
        channels = [grpc.aio.insecure_channel(address) for _ in range(10)]
        calls = [raw_stream(channels[i % 10])() for i in range(100)]
        await asyncio.sleep(1.0)  # the streams are open and idle
        codes = [c.code() for c in calls if c.done()]
        with tg.InferenceServerClient(f"unix://{unix}") as client:
            live = await asyncio.to_thread(client.is_server_live)
        for call in calls:
            call.cancel()
        for channel in channels:
            await channel.close()
        return live, [str(c) for c in await asyncio.gather(*codes)] if codes else []

    live, refused = asyncio.run(scenario())
    assert live
    assert all("RESOURCE_EXHAUSTED" in code for code in refused)  # TCP's own budget, if hit


def test_a_stream_that_is_never_read_is_not_run_ahead(daemon: Daemon) -> None:
    """The client writes and never reads: the daemon runs at most STREAM_IN_FLIGHT of the
    stream's requests (and the transport's buffer) and then stops reading it; once the client
    reads, every request is answered."""
    address = f"127.0.0.1:{grpc_port(daemon)}"
    total = 200
    payload = infer_request()

    async def scenario() -> tuple[int, int, int]:
        before = await inference_count(address)
        # A small receive window, as a client that does not read soon has: the answers then
        # wait in the daemon, not in this client's transport.
        small = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
        async with grpc.aio.insecure_channel(address, options=small) as channel:
            call = raw_stream(channel)()

            async def write_all() -> None:
                for _ in range(total):
                    await call.write(payload)
                await call.done_writing()

            writer = asyncio.ensure_future(write_all())
            await asyncio.sleep(4.0)  # the client writes as fast as it may, reads nothing
            ran_unread = await inference_count(address) - before
            answers = 0
            async for raw in call:
                response = service_pb2.ModelStreamInferResponse.FromString(raw)
                assert not response.error_message, response.error_message
                answers += 1
            await writer
        return ran_unread, answers, await inference_count(address) - before

    ran_unread, answers, ran = asyncio.run(scenario())
    # Run before the client read anything: the stream's in-flight bound, one the reader
    # holds while it waits for a slot, and the answers the client's own transport took in
    # (its 1 KiB window, a few dozen small answers; measured 31 in all). Unbounded, all 200.
    assert ran_unread <= 3 * STREAM_IN_FLIGHT, ran_unread
    assert answers == total and ran == total


def test_an_idle_stream_is_ended(daemon: Daemon) -> None:
    """grpc_idle_timeout_s = 2 here: a stream that sends nothing is ended with the reason."""
    address = f"127.0.0.1:{grpc_port(daemon)}"

    async def scenario() -> tuple[grpc.StatusCode, str, float]:
        async with grpc.aio.insecure_channel(address) as channel:
            call = raw_stream(channel)()
            start = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in call:
                    pass
            return err.value.code(), err.value.details() or "", time.monotonic() - start

    code, details, waited = asyncio.run(scenario())
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "grpc_idle_timeout_s" in details
    assert 1.5 < waited < 30
