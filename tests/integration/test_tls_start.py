"""``chronomq start`` with ``tlsServerMode=enforcing``: the embedded name server and the broker both serve
TLS only (docs/tls.md), so chronomq's client produces and consumes with ``tls=True``, ``chronomq admin``
works with ``--tls``, and a plaintext client is refused at the name server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from chronomq.client import Admin, ConnectFailed, Message, Producer, PushConsumer, ReceivedMessage
from tests.compat.harness import ChronomqProcess
from tests.conftest import async_wait_for

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parents[2]


async def test_an_enforcing_start_serves_tls_on_both_ports_and_refuses_plaintext(tmp_path: Path) -> None:
    with ChronomqProcess(tmp_path / "data", {"tlsServerMode": "enforcing"}) as proc:
        ns = proc.namesrv_addr
        async with Admin(ns, tls=True) as admin:
            await admin.create_topic("TlsStart", 2)
        async with Producer("PG_tls_start", ns, tls=True) as p:
            sent = {(await p.send(Message("TlsStart", f"m{i}".encode()))).msg_id for i in range(10)}
        got: set[str] = set()

        def listener(m: ReceivedMessage) -> None:
            got.add(m.id)

        consumer = PushConsumer("CG_tls_start", {"TlsStart": "*"}, listener, ns, tls=True,
                                consume_from="first", rebalance_interval=0.5, long_poll_timeout=2.0)
        async with consumer:
            await async_wait_for(lambda: got >= sent, message="10 messages consumed over TLS")
        async with Producer("PG_plain_start", ns, retries=0, send_timeout=2.0) as plain:
            with pytest.raises(ConnectFailed):  # the name server closes a plaintext connection at once
                await plain.send(Message("TlsStart", b"plaintext"))
        assert "plaintext refused" in proc.log_tail()

        ok = _cli("admin", "topics", "-n", ns, "--tls")
        assert ok.returncode == 0 and "TlsStart" in ok.stdout, ok.stdout + ok.stderr
        for args, why in (((), "plaintext"), (("--tls", str(tmp_path / "missing.pem")), "--tls")):
            r = _cli("admin", "topics", "-n", ns, *args)
            assert r.returncode != 0 and "Traceback" not in r.stderr, r.stdout + r.stderr
            assert why != "--tls" or "--tls" in r.stderr, r.stderr


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"),
                                                                       os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "chronomq.cli.main", *args], capture_output=True, text=True,
                          timeout=60, env=env, cwd=REPO)
