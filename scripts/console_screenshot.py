"""Make the README's picture of the console: start `chronomq start --dashboard` on free loopback ports with a
throw-away data dir, give it some traffic (keyed orders, a consumer group, timed messages spread over the next
hours, delay-level messages, a dead letter), open the delayed-messages page in headless chromium and save it.

    .venv/bin/python scripts/console_screenshot.py [--out docs/img/console-delayed.png] [--page /delayed]

Needs Debian's chromium and chromium-driver (as the browser tests do). Bounded: every wait has a deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def traffic(ns: str) -> None:
    from chronomq.client import LATER, Admin, Message, Producer, PushConsumer

    async with Admin(ns) as admin:
        await admin.create_topic("Orders", 4)
        await admin.create_topic("Invoices", 2)
    now = int(time.time() * 1000)
    async with Producer("shop", ns) as p:
        for i in range(300):
            await p.send(Message("Orders", f'{{"order": {i}, "total": {i * 3 % 97}.50}}', keys=[f"order-{i}"],
                                 tags="created"))
        for i in range(120):
            await p.send(Message("Orders", f'{{"order": {i}, "event": "timeout-check"}}', keys=[f"order-{i}"],
                                 tags="timeout", deliver_at=now + 60_000 + i * 97_000))
        for i in range(40):
            await p.send(Message("Invoices", f"invoice {i}", keys=[f"inv-{i}"],
                                 deliver_at=now + 300 + i * 20))
        for i in range(25):
            await p.send(Message("Invoices", f"reminder {i}", delay_level=1 + i % 6))
        await p.send(Message("Payments", b"card declined twice", keys=["pay-9"]))

    async def ok(msg: object) -> None:
        return None

    async def fail(msg: object) -> object:
        return LATER

    opts = dict(namesrv=ns, consume_from="first", rebalance_interval=0.5, offset_commit_interval=0.3)
    consumers = [PushConsumer("billing", "Orders", ok, **opts),
                 PushConsumer("invoicing", "Invoices", ok, **opts),
                 PushConsumer("payments", "Payments", fail, **opts)]
    for c in consumers:
        await c.start()
    deadline = time.monotonic() + 60
    async with Admin(ns) as admin:
        while time.monotonic() < deadline and "%DLQ%payments" not in await admin.list_topics():
            await asyncio.sleep(0.2)
    await asyncio.sleep(2)  # let the console's rates have two readings apart
    for c in consumers:
        await c.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / "docs" / "img" / "console-delayed.png"))
    ap.add_argument("--page", default="/delayed")
    args = ap.parse_args()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    data = Path(tempfile.mkdtemp(prefix="chronomq-shot-"))
    ns_port, broker_port, console_port = free_port(), free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "chronomq.cli.main", "start", "--data-dir", str(data),
         "--namesrv-port", str(ns_port),
         "--broker-port", str(broker_port), "--dashboard", "--dashboard-port", str(console_port),
         "--set", "metricsPort=-1", "--set", "grpcListenPort=-1", "--set", "haListenPort=" + str(free_port()),
         "--set", "messageDelayLevel=1s 5s 10s 30s 1m 2m", "--set", "maxReconsumeTimes=1"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # "chronomq ready ... console=http://..."
        if "console=" not in line:
            raise SystemExit(f"chronomq did not start: {line!r}")
        asyncio.run(traffic(f"127.0.0.1:{ns_port}"))
        opts = webdriver.ChromeOptions()
        opts.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
        profile = tempfile.mkdtemp(prefix="chronomq-chromium-")
        for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--disable-background-networking", "--no-first-run", "--window-size=1360,1500",
                     f"--user-data-dir={profile}"):
            opts.add_argument(flag)
        driver = webdriver.Chrome(service=Service(shutil.which("chromedriver") or "/usr/bin/chromedriver"),
                                  options=opts)
        try:
            base = f"http://127.0.0.1:{console_port}"
            driver.get(base + args.page)  # a first reading for the rates
            time.sleep(1.2)
            driver.get(base + args.page + ("&" if "?" in args.page else "?") + "browse=1&topic=Orders")
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            driver.save_screenshot(args.out)
        finally:
            driver.quit()
            shutil.rmtree(profile, ignore_errors=True)
        print(f"wrote {args.out}")
        return 0
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
