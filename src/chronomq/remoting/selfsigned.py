"""A self-signed certificate for the TLS of the broker's ports (remoting and gRPC), with the standard
library only.

RocketMQ's servers, without a configured certificate (``tlsTestModeEnable``, its default), serve TLS with
a self-signed one (Netty's ``SelfSignedCertificate``); its Java clients do not verify the server's
certificate by default, so that is enough for them. chronomq does the same, without a dependency: an
ECDSA P-256 key, and an X.509 v3 certificate signed by it (ECDSA with SHA-256), written as PEM (the key
as PKCS#8). The arithmetic is plain Python integers; one certificate costs a few ms and is made once per
data dir (see ``ensure``), so constant time does not matter here: the key signs one certificate, with a
nonce from ``secrets``.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import ipaddress
import os
import secrets
import ssl
from pathlib import Path

# NIST P-256 (SEC 2 secp256r1)
_P = 0xFFFFFFFF00000001000000000000000000000000FFFFFFFFFFFFFFFFFFFFFFFF
_A = _P - 3
_N = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551
_G = (0x6B17D1F2E12C4247F8BCE6E563A440F277037D812DEB33A0F4A13945D898C296,
      0x4FE342E2FE1A7F9B8EE7EB4A7C0F9E162BCE33576B315ECECBB6406837BF51F5)

Point = tuple[int, int] | None  # None: the point at infinity


def _add(p: Point, q: Point) -> Point:
    if p is None:
        return q
    if q is None:
        return p
    (x1, y1), (x2, y2) = p, q
    if x1 == x2:
        if (y1 + y2) % _P == 0:
            return None
        lam = (3 * x1 * x1 + _A) * pow(2 * y1, -1, _P) % _P
    else:
        lam = (y2 - y1) * pow(x2 - x1, -1, _P) % _P
    x3 = (lam * lam - x1 - x2) % _P
    return x3, (lam * (x1 - x3) - y1) % _P


def _mul(k: int, p: Point) -> Point:
    out: Point = None
    while k:
        if k & 1:
            out = _add(out, p)
        p = _add(p, p)
        k >>= 1
    return out


# --- DER ------------------------------------------------------------------------------------------------
def _tlv(tag: int, content: bytes) -> bytes:
    n = len(content)
    if n < 0x80:
        return bytes([tag, n]) + content
    size = n.to_bytes((n.bit_length() + 7) // 8, "big")
    return bytes([tag, 0x80 | len(size)]) + size + content


def _seq(*items: bytes) -> bytes:
    return _tlv(0x30, b"".join(items))


def _int(v: int) -> bytes:
    return _tlv(0x02, v.to_bytes(v.bit_length() // 8 + 1, "big"))  # + 1: a leading 0 keeps it positive


def _oid(dotted: str) -> bytes:
    arcs = [int(a) for a in dotted.split(".")]
    out = bytearray([40 * arcs[0] + arcs[1]])
    for arc in arcs[2:]:
        chunk = [arc & 0x7F]
        arc >>= 7
        while arc:
            chunk.append(0x80 | (arc & 0x7F))
            arc >>= 7
        out += bytes(reversed(chunk))
    return _tlv(0x06, bytes(out))


def _time(t: dt.datetime) -> bytes:
    if 1950 <= t.year < 2050:
        return _tlv(0x17, t.strftime("%y%m%d%H%M%SZ").encode())  # UTCTime
    return _tlv(0x18, t.strftime("%Y%m%d%H%M%SZ").encode())  # GeneralizedTime


def _name(common_name: str) -> bytes:
    return _seq(_tlv(0x31, _seq(_oid("2.5.4.3"), _tlv(0x0C, common_name.encode()))))


def _pem(kind: str, der: bytes) -> bytes:
    b64 = base64.encodebytes(der).decode().replace("\n", "")
    lines = [b64[i:i + 64] for i in range(0, len(b64), 64)]
    return ("\n".join([f"-----BEGIN {kind}-----", *lines, f"-----END {kind}-----"]) + "\n").encode()


_EC_PUBLIC_KEY = "1.2.840.10045.2.1"
_PRIME256V1 = "1.2.840.10045.3.1.7"
_ECDSA_SHA256 = "1.2.840.10045.4.3.2"


def generate(common_name: str, hosts: list[str], days: int = 3650,
             now: dt.datetime | None = None, *, client: bool = False) -> tuple[bytes, bytes]:
    """(certificate PEM, PKCS#8 private key PEM): a self-signed P-256 certificate for ``common_name``
    whose subjectAltName lists ``hosts`` (IP addresses as IP entries, names as DNS entries), valid from a
    day before ``now`` for ``days`` days; for a server (extKeyUsage serverAuth), or with ``client`` for a
    client of mutual TLS (clientAuth)."""
    d = secrets.randbelow(_N - 1) + 1
    pub = _mul(d, _G)
    assert pub is not None
    point = b"\x04" + pub[0].to_bytes(32, "big") + pub[1].to_bytes(32, "big")
    spki = _seq(_seq(_oid(_EC_PUBLIC_KEY), _oid(_PRIME256V1)), _tlv(0x03, b"\x00" + point))
    alt = []
    for h in dict.fromkeys(hosts):  # in order, once each
        try:
            alt.append(_tlv(0x87, ipaddress.ip_address(h).packed))
        except ValueError:
            alt.append(_tlv(0x82, h.encode("idna")))
    usage = "1.3.6.1.5.5.7.3.2" if client else "1.3.6.1.5.5.7.3.1"  # clientAuth, serverAuth
    critical = _tlv(0x01, b"\xff")
    extensions = [
        _seq(_oid("2.5.29.19"), critical, _tlv(0x04, _seq(critical))),  # basicConstraints cA (its own root)
        # keyUsage digitalSignature, keyCertSign
        _seq(_oid("2.5.29.15"), critical, _tlv(0x04, _tlv(0x03, b"\x02\x84"))),
        _seq(_oid("2.5.29.37"), _tlv(0x04, _seq(_oid(usage)))),  # extKeyUsage
        _seq(_oid("2.5.29.14"), _tlv(0x04, _tlv(0x04, hashlib.sha1(point).digest()))),  # subjectKeyIdentifier
        _seq(_oid("2.5.29.17"), _tlv(0x04, _seq(*alt))),  # subjectAltName
    ]
    now = now or dt.datetime.now(dt.UTC)
    algorithm = _seq(_oid(_ECDSA_SHA256))
    tbs = _seq(
        _tlv(0xA0, _int(2)),  # v3
        _int(secrets.randbits(127) | 1 << 126),
        algorithm,
        _name(common_name),
        _seq(_time(now - dt.timedelta(days=1)), _time(now + dt.timedelta(days=days))),
        _name(common_name),
        spki,
        _tlv(0xA3, _seq(*extensions)),
    )
    e = int.from_bytes(hashlib.sha256(tbs).digest(), "big")
    while True:
        k = secrets.randbelow(_N - 1) + 1
        r_point = _mul(k, _G)
        assert r_point is not None
        r = r_point[0] % _N
        s = pow(k, -1, _N) * (e + r * d) % _N
        if r and s:
            break
    cert = _seq(tbs, algorithm, _tlv(0x03, b"\x00" + _seq(_int(r), _int(s))))
    sec1 = _seq(_int(1), _tlv(0x04, d.to_bytes(32, "big")), _tlv(0xA1, _tlv(0x03, b"\x00" + point)))
    pkcs8 = _seq(_int(0), _seq(_oid(_EC_PUBLIC_KEY), _oid(_PRIME256V1)), _tlv(0x04, sec1))
    return _pem("CERTIFICATE", cert), _pem("PRIVATE KEY", pkcs8)


# --- reading back the validity of a certificate made here ---------------------------------------------------
def _read(der: bytes, pos: int) -> tuple[int, int, int]:
    """(tag, start of content, end of content) of the element at ``pos``."""
    tag, n = der[pos], der[pos + 1]
    pos += 2
    if n & 0x80:
        size = n & 0x7F
        n = int.from_bytes(der[pos:pos + size], "big")
        pos += size
    if pos + n > len(der):
        raise ValueError("truncated DER")
    return tag, pos, pos + n


def not_after(cert_pem: bytes) -> dt.datetime:
    """The end of a PEM certificate's validity (ValueError if it cannot be read)."""
    text = cert_pem.decode("ascii", "replace")
    begin, end = "-----BEGIN CERTIFICATE-----", "-----END CERTIFICATE-----"
    if begin not in text or end not in text:
        raise ValueError("not a PEM certificate")
    der = base64.b64decode(text.split(begin, 1)[1].split(end, 1)[0])
    _, pos, _ = _read(der, 0)  # Certificate
    _, pos, tbs_end = _read(der, pos)  # TBSCertificate
    items: list[tuple[int, int, int]] = []
    while pos < tbs_end and len(items) < 5:
        tag, start, stop = _read(der, pos)
        items.append((tag, start, stop))
        pos = stop
    if items and items[0][0] == 0xA0:  # version present: validity is the 5th element, else the 4th
        items = items[1:]
    if len(items) < 4:
        raise ValueError("no validity in the certificate")
    before_end = _read(der, items[3][1])[2]  # notBefore; notAfter follows it
    tag, start, stop = _read(der, before_end)
    raw = der[start:stop].decode()
    fmt = "%y%m%d%H%M%SZ" if tag == 0x17 else "%Y%m%d%H%M%SZ"
    return dt.datetime.strptime(raw, fmt).replace(tzinfo=dt.UTC)


def ensure(directory: Path, common_name: str, hosts: list[str], min_days_left: int = 30,
           now: dt.datetime | None = None) -> tuple[Path, Path, bool]:
    """(certificate path, key path, made now): ``selfsigned.crt`` and ``selfsigned.key`` in
    ``directory``, kept from an earlier start when they load together as a pair and the certificate is
    valid for ``min_days_left`` more days, else made anew (the key file readable by its owner only;
    each file written to a temporary name and renamed). The two renames are not one atomic step: a
    crash between them leaves the new key beside the old certificate, a pair that does not load, so
    the next call makes both anew."""
    now = now or dt.datetime.now(dt.UTC)
    cert_path, key_path = directory / "selfsigned.crt", directory / "selfsigned.key"
    try:
        if not_after(cert_path.read_bytes()) - now > dt.timedelta(days=min_days_left):
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert_path, key_path)
            return cert_path, key_path, False
    except (OSError, ValueError):  # ssl.SSLError is an OSError
        pass
    cert_pem, key_pem = generate(common_name, hosts, now=now)
    directory.mkdir(parents=True, exist_ok=True)
    for path, data, mode in ((key_path, key_pem, 0o600), (cert_path, cert_pem, 0o644)):
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    return cert_path, key_path, True
