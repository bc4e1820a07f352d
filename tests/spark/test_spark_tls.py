"""The ``tls`` option of format("chronomq"): checked on the driver, and given to every client the source
makes, on the driver and on the executors; one small write and one batch read against a ``chronomq start``
whose ports serve TLS only (enforcing)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("pyarrow")  # chronomq.spark's package imports its Arrow schema

from chronomq.client import Message, Producer
from chronomq.remoting import selfsigned
from chronomq.spark import options as o
from chronomq.spark.options import OptionError
from tests.conftest import wait_for

NS = {"namesrv": "127.0.0.1:9876", "subscribe": "T"}


def test_the_tls_option_values(tmp_path: Path) -> None:
    cert, _ = selfsigned.generate("ca", ["127.0.0.1"])
    (tmp_path / "ca.crt").write_bytes(cert)
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    for raw, want in (("true", True), ("TRUE", True), ("false", None), ("", None),
                      (str(tmp_path / "ca.crt"), str(tmp_path / "ca.crt"))):
        assert o.parse_read_options({**NS, "tls": raw}, streaming=False).tls == want, raw
        assert o.parse_write_options({"namesrv": NS["namesrv"], "tls": raw}).tls == want, raw
        assert o.parse_pending_options({"namesrv": NS["namesrv"], "mode": "pending", "tls": raw},
                                       streaming=False).tls == want, raw
    assert o.parse_read_options(NS, streaming=True).tls is None  # default: plaintext
    for raw in ("yes", str(tmp_path / "missing.pem"), str(tmp_path / "junk.pem")):
        with pytest.raises(OptionError, match=r"option 'tls': .* must be true, false or the path of a PEM CA "
                                              r"file .*cannot be used: "):
            o.parse_read_options({**NS, "tls": raw}, streaming=False)


@pytest.mark.spark
def test_write_and_read_against_an_enforcing_broker(spark, tmp_path: Path) -> None:
    from tests.compat.harness import ChronomqProcess

    with ChronomqProcess(tmp_path / "data", {"tlsServerMode": "enforcing"}) as p:
        ns = p.namesrv_addr
        with Producer("spark_tls_pg", ns, tls=True) as producer:  # makes the self-signed certificate
            producer.send_batch([Message("TlsSpark", f"p{i}".encode()) for i in range(4)])
        crt = str(p.data_dir / "tls" / "selfsigned.crt")
        df = spark.createDataFrame([(f"w{i}".encode(),) for i in range(6)], "value binary")
        (df.write.format("chronomq").option("namesrv", ns).option("topic", "TlsSpark").option("tls", "true")
         .mode("append").save())
        want = sorted([f"p{i}".encode() for i in range(4)] + [f"w{i}".encode() for i in range(6)])

        def read(**extra: str) -> list[bytes]:
            r = spark.read.format("chronomq").option("namesrv", ns).option("subscribe", "TlsSpark")
            for k, v in extra.items():
                r = r.option(k, v)
            return sorted(row.value for row in r.load().select("value").collect())

        # verified against the broker's certificate, on the driver (planning) and the executors (reads)
        wait_for(lambda: read(tls=crt) == want, timeout=20, message="the 10 rows read over TLS")
        with pytest.raises(Exception, match="connection closed"):  # plaintext: the name server refuses
            read(requestTimeoutMs="2000")
    assert "plaintext refused" in p.log_tail()
