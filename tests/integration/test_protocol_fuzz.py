"""Hostile traffic against a real `chronomq start` (broker and embedded name server): thousands of frames
with hostile values (random request codes, garbage header fields and bodies), garbage headers and broken
streams over many connections (tests/integration/frame_fuzz.py). Both stay up, answer a well-formed
request after every round, say nothing but error codes to the garbage (never a traceback), keep a real
client working, and their memory stays within bounds. bench/fuzz_frames.py runs the million-frame version."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from chronomq.client import Message, Producer, SimpleConsumer
from tests.compat.harness import ChronomqProcess
from tests.integration.frame_fuzz import flood, rss_bytes, seed_from_env

pytestmark = pytest.mark.timeout(300)
FRAMES = 8_000


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChronomqProcess]:
    p = ChronomqProcess(tmp_path_factory.mktemp("fuzz") / "data")
    p.start()
    try:
        yield p
    finally:
        p.stop()


def _addr(hostport: str) -> tuple[str, int]:
    host, _, port = hostport.rpartition(":")
    return host, int(port)


@pytest.mark.parametrize("target", ["broker", "namesrv"])
def test_hostile_frames_leave_the_server_up_and_answering(server: ChronomqProcess, target: str) -> None:
    pid = server.pid
    assert pid is not None
    rss_before, heap_before = rss_bytes(pid), rss_bytes(pid, "RssAnon")
    if target == "broker":
        stats = flood(_addr(server.broker_addr), FRAMES, connections=16, seed=seed_from_env(), probe_code=28)
    else:
        stats = flood(_addr(server.namesrv_addr), FRAMES, connections=16, seed=seed_from_env() + 1,
                      probe_code=106)
    rss_after, heap_after = rss_bytes(pid), rss_bytes(pid, "RssAnon")
    print(f"{target}: {stats.frames} frames over {stats.connections} connections in {stats.seconds:.1f} s, "
          f"{stats.structured} well formed, {stats.answered} answers, {stats.closed_by_server} closed by the "
          f"server; "
          f"RSS {rss_before / 2**20:.1f} -> {rss_after / 2**20:.1f} MiB, heap {heap_before / 2**20:.1f} -> "
          f"{heap_after / 2**20:.1f} MiB")
    assert server.running, server.log_tail()
    assert stats.frames == FRAMES and not stats.probes_failed, stats.probes_failed[:5]
    assert stats.probes_ok >= 10 and stats.tracebacks == []
    # every well-formed frame is answered (an error code at worst), but the oneway ones (one in ten)
    assert stats.answered >= 0.8 * stats.structured, (stats.answered, stats.structured)
    # the heap stays flat; the rest of RSS is the mapped pages of what the hostile sends stored
    assert heap_after < heap_before + 32 * 2**20, (heap_before, heap_after)
    assert "Traceback" not in server.log_tail(200_000)


def test_a_real_client_still_works_after_the_flood(server: ChronomqProcess) -> None:
    with Producer("fuzz_after", server.namesrv_addr) as p:
        sent = p.send(Message("AfterFuzz", b"still here"))
    with SimpleConsumer("fuzz_after_c", server.namesrv_addr) as c:
        got = [m.body for q in c.queues("AfterFuzz") for m in c.pull(q, 0, 8).messages]
    assert got == [b"still here"] and sent.msg_id
