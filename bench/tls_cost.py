"""What TLS costs on the remoting port: chronomq.client's send and pull rates over TLS against plaintext,
in the same run, on the same machine (docs/tls.md, "Cost").

    .venv/bin/python bench/tls_cost.py [--count N] [--rounds R]

Two brokers run in child processes (a name server and a broker each, on loopback, ASYNC_FLUSH): one built
without TLS settings (the remoting server as it was before TLS: no first-byte check at all), one in
permissive mode (TLS and plaintext on one port, the self-signed certificate). Three cases, in turn, each
round: ``off`` (plaintext client, broker without TLS settings), ``plain`` (plaintext client, permissive
broker: what the first-byte check costs) and ``tls`` (``tls=True`` client, permissive broker). Each case
sends N 1 KiB messages (64 async sends in flight), then pulls them back with a SimpleConsumer (batches of
32, the queues in parallel), then sends N/10 one at a time. Printed: messages/s and CPU microseconds per
message of this process (time.process_time) and of the broker's process (/proc/<pid>/stat), the median
over the rounds, and tls as a ratio to plain. First, without sockets: what the server's TLS layer
(``TlsSession``) itself costs per 1.2 KB request and 300 B answer, one per record and 13 per record.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chronomq.client import Admin, Message, Producer, SimpleConsumer
from chronomq.remoting import selfsigned
from chronomq.remoting.tls import ServerTls, TlsOption, TlsSession, TlsSettings, client_context

BODY = base64.b64encode(os.urandom(1024))[:1024]  # 1 KiB, hardly compressible
QUEUES = 4

_CHILD = """
import asyncio, sys
from chronomq.broker.controller import BrokerController, connection_limits
from chronomq.clock import SystemClock
from chronomq.config import BrokerConfig
from chronomq.namesrv import NameServer
from chronomq.remoting.tls import ServerTls

data, ns_port, port, ha_port, mode = sys.argv[1:]
config, _ = BrokerConfig.load(None, {{"storePathRootDir": data, "listenPort": port, "haListenPort": ha_port,
                                     "namesrvAddr": "127.0.0.1:" + ns_port, "metricsPort": "-1",
                                     "tlsServerMode": "permissive" if mode == "tls" else "disabled"}})

async def main():
    clock = SystemClock()
    tls = ServerTls.from_config(config, "namesrv") if mode == "tls" else None
    ns = NameServer("127.0.0.1", int(ns_port), clock, limits=connection_limits(config), tls=tls)
    broker = BrokerController(config, clock, local_register=ns.routes.register_broker)
    # the broker's own: permissive, or none at all (the server as before TLS, not even the first-byte check)
    broker.server.tls = ServerTls.from_config(config, "broker") if mode == "tls" else None
    await ns.start()
    await broker.start()
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes stdin
    await broker.shutdown()
    await ns.stop()

asyncio.run(main())
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Broker:
    def __init__(self, root: Path, mode: str) -> None:
        self.ns = f"127.0.0.1:{_free_port()}"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD.format(), str(root / mode), self.ns.rsplit(":", 1)[1],
             str(_free_port()), str(_free_port()), mode],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            raise SystemExit(f"the {mode} broker did not start: {line!r}")

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Meter:
    """Messages/s and CPU us/message of this process and the broker's over one measured step."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker

    def __enter__(self) -> Meter:
        self.t0, self.c0, self.b0 = time.monotonic(), time.process_time(), self.broker.cpu_s()
        return self

    def __exit__(self, *_: object) -> None:
        self.wall = time.monotonic() - self.t0
        self.cpu = time.process_time() - self.c0
        self.broker_cpu = self.broker.cpu_s() - self.b0

    def figures(self, n: int) -> tuple[float, float, float]:
        return n / self.wall, self.cpu / n * 1e6, self.broker_cpu / n * 1e6


async def one_case(broker: Broker, tls: TlsOption, topic: str, count: int) -> dict[str, tuple[float, ...]]:
    out: dict[str, tuple[float, ...]] = {}
    async with Admin(broker.ns, tls=tls) as admin:
        await admin.create_topic(topic, QUEUES)
    async with Producer("PG_tls_cost", broker.ns, tls=tls) as p:
        await p.send(Message(topic, BODY))  # routes and connections made before the clock starts
        sem = asyncio.Semaphore(64)

        async def send_one() -> None:
            async with sem:
                await p.send(Message(topic, BODY))

        with Meter(broker) as m:
            await asyncio.gather(*(send_one() for _ in range(count)))
        out["send, 64 in flight"] = m.figures(count)
        single = max(1, count // 10)
        with Meter(broker) as m:
            for _ in range(single):
                await p.send(Message(topic, BODY))
        out["send, one at a time"] = m.figures(single)
    total = count + 1 + single
    async with SimpleConsumer("CG_tls_cost", broker.ns, tls=tls) as c:
        queues = await c.queues(topic)
        await c.pull(queues[0], 0, 1)  # the broker's connection made before the clock starts

        async def drain(q: object) -> int:
            offset = got = 0
            while True:
                res = await c.pull(q, offset, 32)  # type: ignore[arg-type]
                if not res.messages:
                    return got
                got += len(res.messages)
                offset = res.next_offset

        with Meter(broker) as m:
            pulled = sum(await asyncio.gather(*(drain(q) for q in queues)))
        assert pulled == total, (pulled, total)
        out["pull, batches of 32"] = m.figures(pulled)
    return out


def layer_cost(tmp: Path, n: int = 2000) -> None:
    """The server's TLS layer alone, in memory: decrypting requests, encrypting answers."""
    cert, key = selfsigned.generate("chronomq bench", ["127.0.0.1"])
    (tmp / "bench.crt").write_bytes(cert)
    (tmp / "bench.key").write_bytes(key)
    server = TlsSession(ServerTls(TlsSettings("permissive", cert_path=tmp / "bench.crt",
                                              key_path=tmp / "bench.key")).context())
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    client = client_context(True).wrap_bio(incoming, outgoing)  # type: ignore[union-attr]
    while not server.handshaken:
        try:
            client.do_handshake()
        except ssl.SSLWantReadError:
            pass
        server.receive(outgoing.read())
        incoming.write(server.take())
    for per_record in (1, 13):
        records = []
        for _ in range(n):
            client.write(b"q" * 1200 * per_record)
            records.append(outgoing.read())
        t0 = time.process_time()
        for r in records:
            server.receive(r)
        t1 = time.process_time()
        for _ in range(n):
            server.send(b"a" * 300 * per_record)
        t2 = time.process_time()
        frames = n * per_record
        rx, tx = (t1 - t0) / frames * 1e6, (t2 - t1) / frames * 1e6
        print(f"server TLS layer, {per_record:>2} request(s) per record: decrypt {rx:.2f} us per 1.2 KB "
              f"request, encrypt {tx:.2f} us per 300 B answer")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=20_000, help="messages per case and round (default 20000)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, cases in turn within each (default 3)")
    args = ap.parse_args()
    cases: list[tuple[str, str, TlsOption]] = [("off", "off", None), ("plain", "tls", None),
                                               ("tls", "tls", True)]
    results: dict[str, dict[str, list[tuple[float, ...]]]] = {name: {} for name, _, _ in cases}
    with tempfile.TemporaryDirectory(prefix="chronomq-tls-cost-") as tmp:
        layer_cost(Path(tmp))
        brokers = {mode: Broker(Path(tmp), mode) for mode in ("off", "tls")}
        try:
            for r in range(args.rounds):
                for name, mode, tls in cases:
                    figures = asyncio.run(one_case(brokers[mode], tls, f"TlsCost_{name}_{r}", args.count))
                    for step, f in figures.items():
                        results[name].setdefault(step, []).append(f)
        finally:
            for b in brokers.values():
                b.stop()
    print(f"chronomq.client, 1 KiB messages, {args.count} per case, median of {args.rounds} rounds; "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{'step':<22} {'case':<6} {'msgs/s':>9} {'client us/msg':>14} {'broker us/msg':>14}")
    for step in results["off"]:
        med = {name: [statistics.median(col) for col in zip(*results[name][step], strict=True)]
               for name, _, _ in cases}
        for name, _, _ in cases:
            rate, cpu, bcpu = med[name]
            print(f"{step:<22} {name:<6} {rate:>9.0f} {cpu:>14.1f} {bcpu:>14.1f}")
        (rp, cp, bp), (rt, ct, bt) = med["plain"], med["tls"]
        print(f"{step:<22} {'tls/plain':<6} {rt / rp:>9.2f} {ct / cp:>14.2f} {bt / bp:>14.2f}")


if __name__ == "__main__":
    main()
