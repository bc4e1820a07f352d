"""Connection floods and slow-loris against a real `chronomq start` with small limits: beyond the per-address
limit connections are accepted and closed at once while another address is still answered, slow frames
are cut off, and once the flood is gone the flooding address is answered again and the server holds no
descriptor for any of the flood's connections. bench/fuzz_frames.py runs the 5,000-connection version
under default limits."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.compat.harness import ChronomqProcess
from tests.integration.frame_fuzz import connection_flood

pytestmark = pytest.mark.timeout(120)
KEEP = 200


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChronomqProcess]:
    p = ChronomqProcess(tmp_path_factory.mktemp("flood") / "data",
                        {"serverMaxConnectionsPerIp": str(KEEP), "serverFrameReadTimeoutMillis": "1000"})
    p.start()
    try:
        yield p
    finally:
        p.stop()


@pytest.mark.parametrize("target", ["broker", "namesrv"])
def test_a_flood_is_refused_slow_frames_are_cut_and_the_server_keeps_answering(
    server: ChronomqProcess, target: str
) -> None:
    pid = server.pid
    assert pid is not None
    hostport, code = (server.broker_addr, 28) if target == "broker" else (server.namesrv_addr, 106)
    host, _, port = hostport.rpartition(":")
    st = connection_flood((host, int(port)), pid, 1500, KEEP, code, slow=20, max_seconds=60)
    print(f"{target}: {st.opened} connections, {st.kept} kept; slow-loris {st.slow_closed}/{st.slow} closed; "
          f"open files {st.fds}, held for the flood {st.held}; RSS {[round(r / 2**20, 1) for r in st.rss]} "
          f"MiB; {st.seconds:.1f} s")
    assert st.opened == 1500 and st.kept == KEEP
    assert st.probes_during and all(c == 0 for c in st.probes_during), st.probes_during
    assert st.slow_closed == st.slow == 20
    assert st.probe_after == 0
    # the server's own end of each connection it keeps, and of none once they are closed; counted by the
    # peer's port, as the server's total of open files also moves with files it opens and closes by itself
    assert st.held == (KEEP, 0), st.held
    assert st.rss[2] < st.rss[0] + 32 * 2**20
    assert server.running and "Traceback" not in server.log_tail(200_000)
