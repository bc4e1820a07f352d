"""Delay report: per-level delivery lateness of delayed messages, as a table and a PNG chart.

A batch Spark job on the ``chronomq`` source. chronomq's level scheduler re-puts a due message on its
real topic keeping, as RocketMQ's does, its ``DELAY`` (the level), ``REAL_TOPIC`` and its message id
(``UNIQ_KEY``). The parked copy is still readable in ``SCHEDULE_TOPIC_XXXX`` (queue level-1) with the same
id and ``REAL_TOPIC``, and the source gives it a ``deliver_time`` (its store time + the level's delay, from
the broker's level table). So

    lateness = store time of the re-put message (``timestamp``) - intended ``deliver_time``

per delivered message, joined on (id, level, real topic): a message retried later is parked again under
the same id, but for its retry topic. The report prints count / p50 / p99 / max per level,
writes ``report.csv`` and ``report.png`` (a bar chart of p50 and p99 per level).

    python examples/delay_report/report.py --namesrv 127.0.0.1:9876 --topic orders --out /tmp/delay_report
"""

from __future__ import annotations

import argparse
import csv
import json
import struct
import sys
import zlib
from pathlib import Path
from typing import Any

SCHEDULE_TOPIC = "SCHEDULE_TOPIC_XXXX"


def lateness_rows(spark: Any, namesrv: str, topics: str) -> list[dict[str, Any]]:
    """[{level, delay_ms, count, p50_ms, p99_ms, max_ms, early}] for the delayed messages delivered to
    ``topics`` (comma-separated)."""
    from pyspark.sql import functions as F

    def read(topic: str) -> Any:
        return spark.read.format("chronomq").option("namesrv", namesrv).option("subscribe", topic).load()

    prop = F.col("properties").getItem
    delivered = read(topics).where(prop("DELAY").isNotNull()).select(
        prop("UNIQ_KEY").alias("id"),
        prop("DELAY").cast("int").alias("level"),
        F.col("topic").alias("real_topic"),
        F.col("timestamp").alias("delivered_at"),
    )
    parked = read(SCHEDULE_TOPIC).select(
        prop("UNIQ_KEY").alias("id"),
        (F.col("partition") + 1).alias("level"),
        prop("REAL_TOPIC").alias("real_topic"),
        "deliver_time",
        F.col("timestamp").alias("parked_at"),
    )
    joined = delivered.join(parked, ["id", "level", "real_topic"]).select(
        "level",
        ((F.col("deliver_time").cast("double") - F.col("parked_at").cast("double")) * 1000).alias("delay_ms"),
        ((F.col("delivered_at").cast("double") - F.col("deliver_time").cast("double")) * 1000).alias(
            "late_ms"
        ),
    )
    agg = (
        joined.groupBy("level")
        .agg(
            F.count("*").alias("count"),
            F.max("delay_ms").alias("delay_ms"),
            F.percentile_approx("late_ms", 0.5, 10000).alias("p50_ms"),
            F.percentile_approx("late_ms", 0.99, 10000).alias("p99_ms"),
            F.max("late_ms").alias("max_ms"),
            F.sum(F.when(F.col("late_ms") < 0, 1).otherwise(0)).alias("early"),
        )
        .orderBy("level")
    )
    return [
        {k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.asDict().items()}
        for r in agg.collect()
    ]


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = ["level", "delay_ms", "count", "p50_ms", "p99_ms", "max_ms", "early"]
    print(" ".join(f"{c:>10}" for c in cols))
    for r in rows:
        print(" ".join(f"{r[c]!s:>10}" for c in cols))


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    cols = ["level", "delay_ms", "count", "p50_ms", "p99_ms", "max_ms", "early"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)


# --- the chart ---------------------------------------------------------------------------------------
def write_png(rows: list[dict[str, Any]], path: Path) -> None:
    """A bar chart of p50 (light) and p99 (dark) lateness per level. matplotlib when it is installed;
    otherwise a small built-in renderer (bars, axis, digit labels), so the example has no extra
    dependency."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _png_builtin(rows, path)
        return
    levels = [r["level"] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4))
    xs = range(len(levels))
    ax.bar([x - 0.2 for x in xs], [r["p50_ms"] for r in rows], 0.4, label="p50")
    ax.bar([x + 0.2 for x in xs], [r["p99_ms"] for r in rows], 0.4, label="p99")
    ax.set_xticks(list(xs), [str(v) for v in levels])
    ax.set_xlabel("delay level")
    ax.set_ylabel("lateness (ms)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


# 3x5 digit font for the built-in renderer
_FONT = {
    "0": "111101101101111",
    "1": "010110010010111",
    "2": "111001111100111",
    "3": "111001111001111",
    "4": "101101111001001",
    "5": "111100111001111",
    "6": "111100111101111",
    "7": "111001001001001",
    "8": "111101111101111",
    "9": "111101111001111",
    ".": "000000000000010",
    "-": "000000111000000",
}


def _png_builtin(rows: list[dict[str, Any]], path: Path, width: int = 640, height: int = 320) -> None:
    img = [[(255, 255, 255)] * width for _ in range(height)]

    def rect(x0: int, y0: int, x1: int, y1: int, color: tuple[int, int, int]) -> None:
        for y in range(max(0, y0), min(height, y1)):
            row = img[y]
            for x in range(max(0, x0), min(width, x1)):
                row[x] = color

    def text(x: int, y: int, s: str, scale: int = 2) -> None:
        for ch in s:
            bits = _FONT.get(ch)
            if bits:
                for i, b in enumerate(bits):
                    if b == "1":
                        rect(
                            x + (i % 3) * scale,
                            y + (i // 3) * scale,
                            x + (i % 3 + 1) * scale,
                            y + (i // 3 + 1) * scale,
                            (0, 0, 0),
                        )
            x += 4 * scale

    left, bottom, top = 60, height - 30, 20
    rect(left, top, left + 1, bottom, (0, 0, 0))
    rect(left, bottom, width - 10, bottom + 1, (0, 0, 0))
    vmax = max([max(r["p99_ms"], r["p50_ms"], 0) for r in rows] + [1.0])
    text(4, top, f"{vmax:.0f}")
    text(4, bottom - 10, "0")
    n = max(1, len(rows))
    slot = (width - left - 20) // n
    for i, r in enumerate(rows):
        x = left + 10 + i * slot
        bw = max(2, slot // 3)
        for j, (key, color) in enumerate((("p50_ms", (120, 170, 230)), ("p99_ms", (20, 60, 140)))):
            h = int((bottom - top) * max(r[key], 0) / vmax)
            rect(x + j * bw, bottom - h, x + (j + 1) * bw - 1, bottom, color)
        text(x, bottom + 8, str(r["level"]))
    raw = b"".join(b"\x00" + bytes(c for px in row for c in px) for row in img)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    png = (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(raw, 6))
        + chunk(b"IEND", b"")
    )
    path.write_bytes(png)


def run(spark: Any, namesrv: str, topics: str, out: Path) -> list[dict[str, Any]]:
    out.mkdir(parents=True, exist_ok=True)
    rows = lateness_rows(spark, namesrv, topics)
    write_csv(rows, out / "report.csv")
    write_png(rows, out / "report.png")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--namesrv", default="127.0.0.1:9876")
    ap.add_argument("--topic", required=True, help="topic(s) the delayed messages were delivered to")
    ap.add_argument("--out", default="./delay_report")
    ap.add_argument("--master", default=None, help="e.g. local[*]; leave out under spark-submit")
    a = ap.parse_args(argv)
    from pyspark.sql import SparkSession

    from chronomq.spark import register

    b = SparkSession.builder.appName("chronomq-delay-report")
    if a.master:
        b = b.master(a.master)
    spark = b.getOrCreate()
    register(spark)
    try:
        rows = run(spark, a.namesrv, a.topic, Path(a.out))
        print_table(rows)
        print(json.dumps({"csv": str(Path(a.out) / "report.csv"), "png": str(Path(a.out) / "report.png")}))
    finally:
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
