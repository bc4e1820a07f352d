# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Compiled kernels of the hot paths (a timed message's way in, its delivery): each one is a drop-in for
its pure-Python twin (commitlog.splice_py, put.property_fields_py, put.append_run_py,
put.batch_records_py, reput.queue_runs_py, reads.read_units_py, index.index_entries_py,
index.index_query_py, delivery.record_to_put, codec.batch_items, message.encode_record, pull.due_ms_of,
and the timer's append.pack_timer_records_py, append.pack_index_entries_py, files.pack_hash_entries_py,
window.mark_delivered_run_py), with the same results, the same refusals and the same exception types.
The timer's kernels take what the timer store made itself (positions, sizes, ids, slots, all in range by
construction) and do not repeat the range checks of struct packing. chronomq.store.speedups chooses
between this module and the twins (``kernels``); _speedups.pyi gives mypy its types."""

from cpython.buffer cimport PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.number cimport PyNumber_Index
from cpython.tuple cimport PyTuple_Check, PyTuple_GET_ITEM, PyTuple_GET_SIZE
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_GET_SIZE, PyByteArray_Resize
from cpython.unicode cimport PyUnicode_DecodeASCII, PyUnicode_DecodeUTF8
from libc.stdint cimport int16_t, int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memchr, memcmp, memcpy, memset
from libc.errno cimport EINTR, errno
from cpython.mem cimport PyMem_Calloc, PyMem_Free, PyMem_Malloc
from cpython.dict cimport PyDict_Contains
from posix.unistd cimport pread


cdef extern from "Python.h":
    const char* PyUnicode_AsUTF8AndSize(object s, Py_ssize_t* size) except NULL


cdef extern from "_crc32.h":
    void cmq_crc32_init(int simd) noexcept
    uint32_t cmq_crc32(const uint8_t* p, size_t n, uint32_t crc) noexcept nogil
    uint32_t cmq_crc32_bytes(const uint8_t* p, size_t n, uint32_t crc) noexcept nogil
    int cmq_crc_simd


cmq_crc32_init(1)


cdef inline uint32_t _crc_of(object data, uint32_t value=0, bint bytewise=False) except? 0xFFFFFFFF:
    cdef Py_buffer v
    cdef uint32_t out
    PyObject_GetBuffer(data, &v, PyBUF_SIMPLE)
    try:
        if bytewise:
            out = cmq_crc32_bytes(<const uint8_t*>v.buf, v.len, value)
        else:
            out = cmq_crc32(<const uint8_t*>v.buf, v.len, value)
    finally:
        PyBuffer_Release(&v)
    return out


def crc32(object data, object value=0):
    """zlib.crc32 (same results; the start value taken modulo 2**32 as zlib does), folded with carry-less
    multiplies where the CPU has them."""
    return _crc_of(data, <uint32_t>(PyNumber_Index(value) & 0xFFFFFFFF))


def crc32_bytewise(object data, object value=0):
    """The table path of ``crc32`` alone (what a CPU without PCLMULQDQ runs)."""
    return _crc_of(data, <uint32_t>(PyNumber_Index(value) & 0xFFFFFFFF), True)


def crc32_folds() -> bool:
    """Whether ``crc32`` folds with carry-less multiplies on this CPU."""
    return bool(cmq_crc_simd)


# The V1 record layout and property names (chronomq.message; a test checks they agree). Nothing is
# imported from chronomq at load time, so loading this module never depends on import order.
DEF_MAGIC_V1 = 0xDAA320A7 - (1 << 32)
PROPERTY_KEYS = "KEYS"
PROPERTY_TAGS = "TAGS"
PROPERTY_UNIQ_KEY = "UNIQ_KEY"
MAX_PROPERTIES_LENGTH = 32767
RECORD_FIXED_SIZE = 91
POS_BODY = 88
HOST_V6_FLAGS = 0x10 | 0x20  # SYSFLAG_BORNHOST_V6 | SYSFLAG_STOREHOST_V6

cdef int32_t C_MAGIC = DEF_MAGIC_V1
cdef Py_ssize_t C_FIXED = RECORD_FIXED_SIZE
cdef Py_ssize_t C_BODY = POS_BODY
cdef Py_ssize_t C_MAX_PROPS = MAX_PROPERTIES_LENGTH
cdef int32_t C_HOST_MASK = ~HOST_V6_FLAGS


cdef object _format_error(str text):
    from chronomq.message import MessageFormatError as cls
    return cls(text)


cdef inline int32_t rd32(const uint8_t* p) noexcept nogil:
    return <int32_t>((<uint32_t>p[0] << 24) | (<uint32_t>p[1] << 16) | (<uint32_t>p[2] << 8) | p[3])


cdef inline void wr32(uint8_t* p, int64_t v) noexcept nogil:
    p[0] = (v >> 24) & 0xFF
    p[1] = (v >> 16) & 0xFF
    p[2] = (v >> 8) & 0xFF
    p[3] = v & 0xFF


cdef inline dict _props_of(const uint8_t* p, Py_ssize_t n):
    """decode_properties over UTF-8 bytes: items split on 0x02, name and value on the first 0x01;
    empty items and items without a separator or with an empty name are skipped; a later name wins.
    Splitting the bytes equals splitting the decoded text: 0x01 and 0x02 never occur inside a
    multi-byte UTF-8 sequence, and a piece is valid UTF-8 exactly when the whole is."""
    cdef dict props = {}
    cdef Py_ssize_t i = 0, j, s
    cdef const uint8_t* q
    if n == 0:
        return props
    while i <= n:
        q = <const uint8_t*>memchr(p + i, 2, n - i) if i < n else NULL
        j = (q - p) if q != NULL else n
        if j > i:
            q = <const uint8_t*>memchr(p + i, 1, j - i)
            if q != NULL:
                s = q - p
                if s > i:
                    props[PyUnicode_DecodeUTF8(<const char*>p + i, s - i, NULL)] = \
                        PyUnicode_DecodeUTF8(<const char*>p + s + 1, j - s - 1, NULL)
                else:
                    # an empty name: skipped, but its bytes must still be valid UTF-8
                    PyUnicode_DecodeUTF8(<const char*>p + s + 1, j - s - 1, NULL)
            else:
                PyUnicode_DecodeUTF8(<const char*>p + i, j - i, NULL)
        i = j + 1
    return props


def record_to_put(object buf, Py_ssize_t pos, Py_ssize_t size):
    """delivery.record_to_put: (topic, queue id, properties) of the V1 record of ``size`` bytes at
    ``buf[pos:]``. Raises MessageFormatError."""
    cdef Py_buffer view
    cdef const uint8_t* b
    cdef Py_ssize_t blen, p, end, topic_len, props_len, tl
    cdef int32_t total, magic, queue_id, body_len
    PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE)
    try:
        b = <const uint8_t*>view.buf
        blen = view.len
        if size < C_FIXED or pos + size > blen or pos < 0:
            raise _format_error("record truncated")
        total = rd32(b + pos)
        magic = rd32(b + pos + 4)
        queue_id = rd32(b + pos + 12)
        if magic != C_MAGIC:
            raise _format_error(f"bad magic code {(<int64_t>magic) & 0xFFFFFFFF:#x}")
        if total != size:
            raise _format_error("record length does not match its envelope")
        body_len = rd32(b + pos + C_BODY - 4)
        end = pos + size
        p = pos + C_BODY
        if body_len < 0 or p + body_len + 3 > end:
            raise _format_error("body length out of range")
        p += body_len
        topic_len = b[p]
        p += 1
        tl = min(topic_len, blen - p)  # a slice past the buffer is cut short, as in Python
        try:
            topic = PyUnicode_DecodeUTF8(<const char*>b + p, tl, NULL)
        except UnicodeDecodeError as e:
            raise _format_error("topic is not UTF-8") from e
        p += topic_len
        if p + 2 > end:
            raise _format_error("properties length out of range")
        props_len = (<Py_ssize_t>b[p] << 8) | b[p + 1]
        p += 2
        if p + props_len != end:
            raise _format_error("record length does not match its fields")
        try:
            props = _props_of(b + p, props_len)
        except UnicodeDecodeError as e:
            raise _format_error("properties are not UTF-8") from e
        return topic, queue_id, props
    finally:
        PyBuffer_Release(&view)


cdef bytes _join_props(dict props, Py_ssize_t total):
    """name 0x01 value 0x02 ... for str names and values whose UTF-8 sizes add up to ``total``."""
    cdef Py_ssize_t kl, vl
    cdef const char* kp
    cdef const char* vp
    cdef char* out
    props_b = PyBytes_FromStringAndSize(NULL, total)
    out = PyBytes_AS_STRING(props_b)
    for k, v in props.items():
        kp = PyUnicode_AsUTF8AndSize(k, &kl)
        vp = PyUnicode_AsUTF8AndSize(v, &vl)
        memcpy(out, kp, kl)
        out[kl] = 1
        memcpy(out + kl + 1, vp, vl)
        out[kl + 1 + vl] = 2
        out += kl + vl + 2
    return props_b


def property_fields(dict props):
    """put.property_fields_py: (properties bytes, TAGS, KEYS words or None, UNIQ_KEY) for a message's
    properties, or the refusal as an int: 0 when a name is empty or a name or value holds a 0x01/0x02
    separator, else the encoded size when it is over MAX_PROPERTIES_LENGTH. A non-str name or value
    raises TypeError, text that cannot be UTF-8 UnicodeEncodeError."""
    cdef Py_ssize_t n, total = 0, kl, vl
    cdef const char* kp
    cdef const char* vp
    cdef char* out
    cdef list parts
    cdef bint illegal = False
    if not props:
        return b"", None, None, None
    bad_text = None
    # the order of the pure join: a non-str raises first, then a separator refuses, then text that
    # cannot be UTF-8 raises
    for k, v in props.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"property names and values must be str, not {type(k).__name__}: "
                            f"{type(v).__name__}")
        try:
            kp = PyUnicode_AsUTF8AndSize(k, &kl)
            vp = PyUnicode_AsUTF8AndSize(v, &vl)
        except UnicodeEncodeError as e:
            bad_text = e
            if not k or "\x01" in k or "\x02" in k or "\x01" in v or "\x02" in v:
                illegal = True
            continue
        total += kl + vl + 2
        if kl == 0 or memchr(kp, 1, kl) != NULL or memchr(kp, 2, kl) != NULL \
                or memchr(vp, 1, vl) != NULL or memchr(vp, 2, vl) != NULL:
            illegal = True
    if illegal:
        return 0
    if bad_text is not None:
        raise bad_text
    if total > C_MAX_PROPS:
        return total
    props_b = _join_props(props, total)
    keys = props.get(PROPERTY_KEYS)
    keys_l = [w for w in keys.split(" ") if w] if keys else None
    return props_b, props.get(PROPERTY_TAGS), keys_l, props.get(PROPERTY_UNIQ_KEY)


def splice(object buf, Py_ssize_t pos, Py_ssize_t size, bytes topic_b, Py_ssize_t queue_id, bytes props_b,
           bytes store_host_b):
    """commitlog.splice_py: the stored V1 record at ``buf[pos:]`` re-addressed to ``topic_b``/``queue_id``
    with the properties ``props_b``; returns (record, body length). Raises ValueError when the bytes
    are not one whole V1 record or a field does not fit its width."""
    cdef Py_buffer view
    cdef const uint8_t* b
    cdef uint8_t* o
    cdef Py_ssize_t tlen = len(topic_b), plen = len(props_b), hl = len(store_host_b), new_total, q
    cdef int32_t total, magic, body_len, sys_flag
    if tlen > 255:
        raise ValueError("topic longer than 255 bytes")
    if plen > 0xFFFF:
        raise ValueError("properties longer than 65535 bytes")
    if queue_id < -0x80000000 or queue_id > 0x7FFFFFFF:
        raise ValueError("queue id out of range")
    PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE)
    try:
        b = <const uint8_t*>view.buf
        if size < C_FIXED or pos < 0 or pos + size > view.len:
            raise ValueError("record truncated")
        b += pos
        total = rd32(b)
        magic = rd32(b + 4)
        if magic != C_MAGIC or total != size:
            raise ValueError("not a V1 record of the given size")
        body_len = rd32(b + 84)
        if body_len < 0 or C_BODY + body_len + 3 > size:
            raise ValueError("body length out of range")
        new_total = C_FIXED + body_len + tlen + plen
        if new_total > 0x7FFFFFFF:
            raise ValueError("record longer than 2 GiB")
        rec = PyBytes_FromStringAndSize(NULL, new_total)
        o = <uint8_t*>PyBytes_AS_STRING(rec)
        wr32(o, new_total)
        wr32(o + 4, C_MAGIC)
        wr32(o + 12, queue_id)
        memcpy(o + 16, b + 16, 4)  # flag
        memset(o + 20, 0, 16)  # queue offset, physical offset
        sys_flag = rd32(b + 36) & C_HOST_MASK
        wr32(o + 36, sys_flag)
        memcpy(o + 40, b + 40, 16)  # born timestamp, born host
        memset(o + 56, 0, 8)  # store timestamp
        memset(o + 64, 0, 8)
        memcpy(o + 64, PyBytes_AS_STRING(store_host_b), min(hl, 8))
        memcpy(o + 72, b + 72, 4)  # reconsume times
        memset(o + 76, 0, 8)  # prepared transaction offset
        wr32(o + 84, body_len)
        memcpy(o + C_BODY, b + C_BODY, body_len)
        q = C_BODY + body_len
        o[q] = <uint8_t>tlen
        memcpy(o + q + 1, PyBytes_AS_STRING(topic_b), tlen)
        q += 1 + tlen
        o[q] = (plen >> 8) & 0xFF
        o[q + 1] = plen & 0xFF
        memcpy(o + q + 2, PyBytes_AS_STRING(props_b), plen)
        # the body CRC over the copy just made (rec is not shared with anyone yet)
        wr32(o + 8, _crc_of(memoryview(rec)[C_BODY : C_BODY + body_len]) & 0x7FFFFFFF)
        return rec, body_len
    finally:
        PyBuffer_Release(&view)


# --- the schedule path: a batch request's items in, the stored record out -------------------------------
MAX_TOPIC_LENGTH = 127
BATCH_HEAD_SIZE = 20  # total, magic, crc, flag, body length

cdef Py_ssize_t C_MAX_TOPIC = MAX_TOPIC_LENGTH
cdef Py_ssize_t C_BATCH_HEAD = BATCH_HEAD_SIZE
cdef dict _packed_hosts = {}
cdef object _pack_host = None
cdef object _struct_error = None


cdef inline void wr64(uint8_t* p, int64_t v) noexcept nogil:
    wr32(p, v >> 32)
    wr32(p + 4, v)  # wr32 keeps the low 32 bits


cdef object _imports():
    global _pack_host, _struct_error
    if _pack_host is None:
        import struct
        from chronomq.message import pack_host
        _pack_host, _struct_error = pack_host, struct.error


def batch_items(object data):
    """codec.batch_items: the items of a batch body (TOTALSIZE | MAGIC | BODYCRC | FLAG | BODYLEN | BODY |
    PROPLEN(int16) | PROPS, repeated) as (body, properties, flag). Raises MessageFormatError."""
    cdef Py_buffer view
    cdef const uint8_t* b
    cdef Py_ssize_t n, pos = 0, p, plen
    cdef int32_t total, flag, blen
    cdef list items = []
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    try:
        b = <const uint8_t*>view.buf
        n = view.len
        while pos < n:
            if n - pos < C_BATCH_HEAD + 2:
                raise _format_error("batch item truncated")
            total = rd32(b + pos)
            flag = rd32(b + pos + 12)
            blen = rd32(b + pos + 16)
            if total < C_BATCH_HEAD + 2 or pos + total > n or blen < 0 or blen > total - C_BATCH_HEAD - 2:
                raise _format_error("batch item length out of range")
            p = pos + C_BATCH_HEAD
            body = PyBytes_FromStringAndSize(<const char*>b + p, blen)
            p += blen
            plen = <int16_t>((b[p] << 8) | b[p + 1])
            p += 2
            if plen < 0 or p + plen != pos + total:
                raise _format_error("batch item properties length out of range")
            try:
                props = _props_of(b + p, plen)
            except UnicodeDecodeError:
                raise _format_error("batch item properties are not UTF-8") from None
            items.append((body, props, flag))
            pos += total
        return items
    finally:
        PyBuffer_Release(&view)


cdef bytes _host(object host):
    try:
        packed = _packed_hosts.get(host)
    except TypeError:  # not hashable: pack it every time
        return _pack_host(host)
    if packed is None:
        packed = _pack_host(host)
        if len(_packed_hosts) >= 4096:
            _packed_hosts.clear()
        _packed_hosts[host] = packed
    return packed


cdef int64_t _field(object v, bint wide) except? -1:
    """A struct 'i' (wide: 'q') field: the same refusals as struct.pack (struct.error)."""
    cdef int64_t x
    try:
        x = v if type(v) is int else PyNumber_Index(v)
    except OverflowError:
        raise _struct_error("argument out of range") from None
    except TypeError:
        raise _struct_error("required argument is not an integer") from None
    if not wide and (x < -0x80000000 or x > 0x7FFFFFFF):
        raise _struct_error("argument out of range")
    return x


def encode_record(object msg, object properties_text=None):
    """message.encode_record: the message in the stored V1 layout, as a bytearray. Raises
    MessageFormatError for a topic or properties too long, struct.error for a field out of range."""
    cdef Py_ssize_t tl, pl, bl, total, kl, vl, p
    cdef const char* tp
    cdef uint8_t* o
    cdef Py_buffer view
    cdef int64_t crc
    _imports()
    tp = PyUnicode_AsUTF8AndSize(msg.topic, &tl)
    if properties_text is None:
        props = msg.properties
        pl = 0
        for k, v in props.items():
            if not isinstance(k, str) or not isinstance(v, str):
                bad = k if not isinstance(k, str) else v
                raise TypeError(f"sequence item: expected str instance, {type(bad).__name__} found")
            PyUnicode_AsUTF8AndSize(k, &kl)
            PyUnicode_AsUTF8AndSize(v, &vl)
            pl += kl + vl + 2
        props_b = _join_props(props, pl)
    else:
        props_b = properties_text.encode()
        pl = len(props_b)
    if tl > C_MAX_TOPIC:
        raise _format_error("topic too long")
    if pl > C_MAX_PROPS:
        raise _format_error("properties too long")
    body = msg.body
    crc = _field(msg.body_crc, False)
    queue_id = _field(msg.queue_id, False)
    flag = _field(msg.flag, False)
    queue_offset = _field(msg.queue_offset, True)
    cl_offset = _field(msg.commit_log_offset, True)
    sys_flag = _field(msg.sys_flag & ~HOST_V6_FLAGS, False)
    born_ts = _field(msg.born_timestamp, True)
    born_host = _host(msg.born_host)
    store_ts = _field(msg.store_timestamp, True)
    store_host = _host(msg.store_host)
    reconsume = _field(msg.reconsume_times, False)
    prepared = _field(msg.prepared_transaction_offset, True)
    PyObject_GetBuffer(body, &view, PyBUF_SIMPLE)
    try:
        bl = view.len
        if not crc:
            crc = _crc_of(body) & 0x7FFFFFFF
        total = C_FIXED + bl + tl + pl
        if total > 0x7FFFFFFF:
            raise _struct_error("argument out of range")
        buf = bytearray(total)
        o = <uint8_t*>(<char*>buf)
        wr32(o, total)
        wr32(o + 4, C_MAGIC)
        wr32(o + 8, crc)
        wr32(o + 12, queue_id)
        wr32(o + 16, flag)
        wr64(o + 20, queue_offset)
        wr64(o + 28, cl_offset)
        wr32(o + 36, sys_flag)
        wr64(o + 40, born_ts)
        memcpy(o + 48, PyBytes_AS_STRING(born_host), min(len(born_host), 8))
        wr64(o + 56, store_ts)
        memcpy(o + 64, PyBytes_AS_STRING(store_host), min(len(store_host), 8))
        wr32(o + 72, reconsume)
        wr64(o + 76, prepared)
        wr32(o + 84, bl)
        memcpy(o + C_BODY, view.buf, bl)
        p = C_BODY + bl
        o[p] = <uint8_t>tl
        memcpy(o + p + 1, tp, tl)
        p += 1 + tl
        o[p] = (pl >> 8) & 0xFF
        o[p + 1] = pl & 0xFF
        memcpy(o + p + 2, PyBytes_AS_STRING(props_b), pl)
        return buf
    finally:
        PyBuffer_Release(&view)


PROPERTY_TIMER_DELIVER_MS = "TIMER_DELIVER_MS"
cdef bytes _DUE_MARK = (PROPERTY_TIMER_DELIVER_MS + "\x01").encode()


cdef inline Py_ssize_t _props_at(const uint8_t* b, Py_ssize_t n) noexcept nogil:
    """pull._props_at: where a stored record's properties start (after their length), or -1."""
    cdef int32_t body_len
    cdef Py_ssize_t p
    if n < C_FIXED:
        return -1
    body_len = rd32(b + C_BODY - 4)
    p = C_BODY + body_len
    if body_len < 0 or p + 3 > n:
        return -1
    return p + 3 + b[p]


cdef int _due_c(bytes rec, int64_t* out) except -1:
    """The TIMER_DELIVER_MS property of ``rec`` (as ``due_ms_of``): 0 when it has none, 1 with the value in
    ``*out``, 2 when its digits are too many for int64 (the caller reads them as Python does)."""
    cdef const uint8_t* b = <const uint8_t*>PyBytes_AS_STRING(rec)
    cdef Py_ssize_t n = len(rec), props = _props_at(b, n), i, start, end, mlen = len(_DUE_MARK)
    cdef const uint8_t* q
    cdef const uint8_t* m = <const uint8_t*>PyBytes_AS_STRING(_DUE_MARK)
    cdef int64_t v = 0
    if props < 0:
        return 0
    i = -1
    start = props
    while start + mlen <= n:  # bytes.find(mark, props)
        q = <const uint8_t*>memchr(b + start, m[0], n - mlen + 1 - start)
        if q == NULL:
            break
        if memcmp(q, m, mlen) == 0:
            i = q - b
            break
        start = q - b + 1
    if i < 0 or (i > props and b[i - 1] != 2):
        return 0
    start = i + mlen
    q = <const uint8_t*>memchr(b + start, 2, n - start) if start < n else NULL
    end = (q - b) if q != NULL else n
    if end <= start:
        return 0
    if end - start > 18:  # beyond int64 arithmetic
        return 2
    for i in range(start, end):
        if b[i] < 48 or b[i] > 57:
            return 0
        v = v * 10 + (b[i] - 48)
    out[0] = v
    return 1


cdef object _due_long(bytes rec):
    """``due_ms_of`` for a value of more than 18 digits: Python's int, as the pure function reads it."""
    cdef const uint8_t* b = <const uint8_t*>PyBytes_AS_STRING(rec)
    cdef Py_ssize_t n = len(rec), props = _props_at(b, n)
    i = rec.find(_DUE_MARK, props)
    start = i + len(_DUE_MARK)
    end = rec.find(b"\x02", start)
    raw = rec[start:end if end >= 0 else n]
    return int(raw) if raw.isdigit() else None


def due_ms_of(bytes rec):
    """pull.due_ms_of: the TIMER_DELIVER_MS property of a stored V1 record, or None (looked up in the
    record's properties only: the first occurrence of the name counts, and only at a property's start)."""
    cdef int64_t v = 0
    cdef int got = _due_c(rec, &v)
    if got == 1:
        return v
    if got == 2:
        return _due_long(rec)
    return None


def count_lateness(list records, object now, dict lates):
    """pull.count_lateness_py: for each record that holds a deliver time, how late ``now`` is after it
    (0 when not after), counted in ``lates`` by value."""
    cdef int64_t v = 0, nc
    cdef int got
    cdef object due, late
    cdef bint small = -(1 << 62) < now < (1 << 62)
    nc = now if small else 0
    for rec in records:
        got = _due_c(<bytes?>rec, &v)
        if got == 0:
            continue
        if got == 1 and small:
            late = nc - v if nc > v else 0
        else:
            due = v if got == 1 else _due_long(rec)
            if due is None:
                continue
            late = now - due if now > due else 0
        lates[late] = lates.get(late, 0) + 1


cdef inline bint _holds(const uint8_t* p, Py_ssize_t n, const uint8_t* m, Py_ssize_t mlen) noexcept nogil:
    """Whether the ``n`` bytes at ``p`` hold the ``mlen`` bytes at ``m``."""
    cdef const uint8_t* q
    cdef Py_ssize_t start = 0
    if mlen == 0:
        return True
    while start + mlen <= n:
        q = <const uint8_t*>memchr(p + start, m[0], n - mlen + 1 - start)
        if q == NULL:
            return False
        if memcmp(q, m, mlen) == 0:
            return True
        start = q - p + 1
    return False


def props_marks(list records, tuple marks):
    """pull.props_marks_py: bit i set when some record's properties (all after its properties' length)
    hold marks[i]; a record whose layout does not lead to its properties counts as holding every mark."""
    cdef Py_buffer view
    cdef const uint8_t* b
    cdef Py_ssize_t n, p, i, count = len(marks)
    cdef int found = 0, every = (1 << count) - 1
    cdef bytes mark
    for m in marks:
        if type(m) is not bytes:
            raise TypeError("props_marks: the marks must be bytes")
    for rec in records:
        PyObject_GetBuffer(rec, &view, PyBUF_SIMPLE)
        try:
            b = <const uint8_t*>view.buf
            n = view.len
            p = _props_at(b, n)
            if p < 0:
                return every
            for i in range(count):
                mark = <bytes>marks[i]
                if not (found >> i) & 1 and _holds(b + min(p, n), n - min(p, n),
                                                   <const uint8_t*>PyBytes_AS_STRING(mark), len(mark)):
                    found |= 1 << i
        finally:
            PyBuffer_Release(&view)
        if found == every:
            break
    return found


cdef extern from "Python.h":
    ctypedef struct PyTypeObject
    object PyType_GenericAlloc(PyTypeObject* t, Py_ssize_t n)
    void Py_INCREF(object o)
    void PyTuple_SET_ITEM(object p, Py_ssize_t pos, object o)
    void PyObject_GC_UnTrack(object o)
    bint PyObject_IS_GC(object o)


cdef object _DispatchRequest = None


cdef inline void _set(object t, Py_ssize_t i, object v):
    Py_INCREF(v)  # PyTuple_SET_ITEM steals a reference
    PyTuple_SET_ITEM(t, i, v)


cdef object _request_type():
    global _DispatchRequest
    if _DispatchRequest is None:
        from chronomq.store.types import DispatchRequest
        _DispatchRequest = DispatchRequest
    return _DispatchRequest


def append_run(object mm, Py_ssize_t r, int64_t wrote, int64_t qoff, int64_t ts, list entries, object topic,
               object qid, list pending):
    """put.append_run_py: copy the encoded records of ``entries`` (EncodedRecord: record, tags hash, delay,
    keys, UNIQ_KEY) into ``mm`` from byte ``r`` on, patch each one's queue offset, physical offset and
    store time, append its DispatchRequest (fields in the order of its class) to ``pending``; returns the
    next (r, wrote, qoff)."""
    cdef Py_buffer view, rv
    cdef uint8_t* b
    cdef Py_ssize_t size
    cdef object e, rec, tags_hash, delay, req, tags_code
    cdef object request_type = _request_type()
    PyObject_GetBuffer(mm, &view, PyBUF_WRITABLE)
    try:
        b = <uint8_t*>view.buf
        for e in entries:
            rec, tags_hash, delay, keys, uniq = e
            PyObject_GetBuffer(rec, &rv, PyBUF_SIMPLE)
            try:
                size = rv.len
                if r < 0 or r + (size if size > 64 else 64) > view.len:  # the caller reserved the room
                    raise ValueError("a record does not fit the mapped segment")
                memcpy(b + r, rv.buf, size)
            finally:
                PyBuffer_Release(&rv)
            wr64(b + r + 20, qoff)
            wr64(b + r + 28, wrote)
            wr64(b + r + 56, ts)
            # the DispatchRequest allocated as the tuple subclass it is and filled in its fields' order
            # (what tuple.__new__(DispatchRequest, fields) does, without the temporary tuple)
            req = PyType_GenericAlloc(<PyTypeObject*>request_type, 9)
            _set(req, 0, wrote)
            _set(req, 1, size)
            _set(req, 2, topic)
            _set(req, 3, qid)
            _set(req, 4, qoff)
            tags_code = tags_hash if delay is None else ts + delay
            _set(req, 5, tags_code)
            _set(req, 6, ts)
            _set(req, 7, keys)
            _set(req, 8, uniq)
            if keys is None and not (PyObject_IS_GC(topic) or PyObject_IS_GC(qid) or PyObject_IS_GC(uniq)
                                     or PyObject_IS_GC(tags_code)):
                # no item the cycle collector tracks: untracked, as CPython untracks a plain tuple of such
                # items at its first collection (it never does for an instance of a subclass)
                PyObject_GC_UnTrack(req)
            pending.append(req)
            qoff += 1
            r += size
            wrote += size
    finally:
        PyBuffer_Release(&view)
    return r, wrote, qoff


# --- the dispatcher's consume-queue units (reput.queue_runs_py) -----------------------------------------
cdef Py_ssize_t C_UNIT = 20  # consumequeue.UNIT: >qiq (commit-log offset, size, tags code)


cdef bytes _pack_units(list reqs, Py_ssize_t start, Py_ssize_t end):
    cdef bytes out = PyBytes_FromStringAndSize(NULL, (end - start) * C_UNIT)
    cdef uint8_t* p = <uint8_t*>PyBytes_AS_STRING(out)
    cdef Py_ssize_t i
    cdef object req
    for i in range(start, end):
        req = reqs[i]
        wr64(p, _field(<object>PyTuple_GET_ITEM(req, 0), True))
        wr32(p + 8, _field(<object>PyTuple_GET_ITEM(req, 1), False))
        wr64(p + 12, _field(<object>PyTuple_GET_ITEM(req, 5), True))
        p += C_UNIT
    return out


def queue_runs(list batch):
    """reput.queue_runs_py: the consume-queue units of ``batch`` queue by queue, in the order the queues
    first appear, as (topic, queue id, first offset, packed units, count, last store time) per run of
    consecutive queue offsets."""
    cdef dict by_queue = {}
    cdef object req, topic, qid, key, lst
    cdef object last_topic = None, last_qid = None
    cdef list last = None, reqs, runs = []
    cdef Py_ssize_t i, start, n
    cdef int64_t prev, off
    _imports()
    for req in batch:
        if not PyTuple_Check(req) or PyTuple_GET_SIZE(req) < 7:
            raise TypeError("a dispatch request is expected")
        topic = <object>PyTuple_GET_ITEM(req, 2)
        qid = <object>PyTuple_GET_ITEM(req, 3)
        if last is not None and topic is last_topic and qid is last_qid:
            last.append(req)  # the same queue as the request before (the same objects)
            continue
        key = (topic, qid)
        lst = by_queue.get(key)
        if lst is None:
            lst = [req]
            by_queue[key] = lst
        else:
            (<list>lst).append(req)
        last, last_topic, last_qid = <list>lst, topic, qid
    for key, lst in by_queue.items():
        reqs = <list>lst
        topic, qid = key
        n = len(reqs)
        start = 0
        prev = <object>PyTuple_GET_ITEM(reqs[0], 4)
        for i in range(1, n + 1):
            if i < n:
                off = <object>PyTuple_GET_ITEM(reqs[i], 4)
                if off == prev + 1:
                    prev = off
                    continue
            runs.append((topic, qid, <object>PyTuple_GET_ITEM(reqs[start], 4), _pack_units(reqs, start, i),
                         i - start, <object>PyTuple_GET_ITEM(reqs[i - 1], 6)))
            if i < n:
                start = i
                prev = off
    return runs


# --- a pull's records from its queue units (reads.read_units_py) ----------------------------------------
def read_units(bytes units, object cl, int64_t min_phys, Py_ssize_t max_msgs, int64_t max_bytes):
    """reads.read_units_py: the records the packed queue ``units`` point at in the commit log ``cl`` (read
    as CommitLog.read does: its segments, its segment size, its written end), the units used, the removed."""
    cdef list segs = cl.segments
    cdef int64_t seg_size = cl.seg_size, wrote = cl.wrote
    cdef Py_ssize_t nseg = len(segs), n = PyBytes_GET_SIZE(units) // C_UNIT, k, cur = -1
    cdef Py_ssize_t used = 0, removed = 0
    cdef const uint8_t* u = <const uint8_t*>PyBytes_AS_STRING(units)
    cdef int64_t first = 0, phys, idx, r, nbytes = 0, seg_start = 0, take
    cdef int32_t size
    cdef list out = []
    cdef object mm = None, data
    cdef Py_buffer view
    if PyBytes_GET_SIZE(units) % C_UNIT:
        _imports()
        raise _struct_error(f"iterative unpacking requires a buffer of a multiple of {C_UNIT} bytes")
    if nseg:
        first = segs[0].start
    for k in range(n):
        phys = rd64(u + k * C_UNIT)
        size = rd32(u + k * C_UNIT + 8)
        if size > 0 and phys >= min_phys:
            if out and nbytes + size > max_bytes:
                break
            data = None
            if nseg and phys >= first and phys + size <= wrote:  # CommitLog.read: segment_for, then wrote
                idx = (phys - first) // seg_size
                if idx < nseg:
                    if idx != cur:
                        seg = segs[idx]
                        mm, seg_start, cur = seg.mm, seg.start, idx
                    r = phys - seg_start
                    try:
                        PyObject_GetBuffer(mm, &view, PyBUF_SIMPLE)
                    except ValueError:  # the segment was cleaned meanwhile
                        pass
                    else:
                        try:  # as the slice mm[r : r + size]
                            if r < 0:
                                r = r + view.len if r + view.len > 0 else 0
                            take = view.len - r if r + size > view.len else size
                            data = PyBytes_FromStringAndSize(<char*>view.buf + r, take if take > 0 else 0)
                        finally:
                            PyBuffer_Release(&view)
            if data is not None:
                out.append(data)
                nbytes += size
                used += 1
                if len(out) >= max_msgs:
                    break
                continue
        if size > 0:
            removed += 1
        used += 1
    return out, used, removed


# --- a send's batch body straight to its records (put.batch_records_py) ---------------------------------
cdef object _EncodedRecord = None
cdef bytes _N_TAGS = b"TAGS"
cdef bytes _N_KEYS = b"KEYS"
cdef bytes _N_UNIQ = b"UNIQ_KEY"
cdef bytes _N_DEDUP = b"CHRONOMQ_DEDUP"
cdef Py_ssize_t C_ITEM_NAMES = 64  # an item with more properties goes the general way


cdef object _encoded_type():
    global _EncodedRecord
    if _EncodedRecord is None:
        from chronomq.store.types import EncodedRecord
        _EncodedRecord = EncodedRecord
    return _EncodedRecord


cdef inline bint _named(const uint8_t* p, Py_ssize_t n, bytes name) noexcept:
    return n == PyBytes_GET_SIZE(name) and memcmp(p, PyBytes_AS_STRING(name), n) == 0


def batch_records(object data, bytes topic_b, int64_t queue_id, int64_t sys_flag, int64_t born_ts,
                  bytes born_host_b, bytes store_host_b, int64_t reconsume, bytes stamps_b, tuple special,
                  Py_ssize_t max_body, Py_ssize_t max_record, object tag_cache):
    """put.batch_records_py: a batch body's items as the records encode would build (their properties
    stored as they came, closed by 0x02, then ``stamps_b``), with (entries, the UNIQ_KEYs asking for
    de-duplication or None, body bytes); None for anything but the plain case."""
    cdef Py_buffer view
    cdef const uint8_t* b
    cdef const uint8_t* q
    cdef uint8_t* o
    cdef Py_ssize_t n, pos = 0, p, bp, plen, blen, total, i, j, s, k, nnames, lim, pl, size, w
    cdef Py_ssize_t tl = PyBytes_GET_SIZE(topic_b), sl = PyBytes_GET_SIZE(stamps_b), bodies = 0
    cdef Py_ssize_t hl = min(PyBytes_GET_SIZE(born_host_b), 8), shl = min(PyBytes_GET_SIZE(store_host_b), 8)
    cdef Py_ssize_t nspecial = len(special)
    cdef Py_ssize_t name_at[64]
    cdef Py_ssize_t name_len[64]
    cdef bint closed, dedup, asked = False
    cdef int32_t flag
    cdef uint32_t crc
    cdef list entries = [], asks = []
    cdef object etype = _encoded_type(), tags, keys, uniq, keys_l, h, ask, e
    cdef bytes sp
    for sp in special:  # a TypeError for anything but bytes, as the pure twin's lookups would not raise
        pass
    if tl > 255:
        return None
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    try:
        b = <const uint8_t*>view.buf
        n = view.len
        if n == 0:
            return None
        while pos < n:
            if n - pos < C_BATCH_HEAD + 2:
                return None
            total = rd32(b + pos)
            flag = rd32(b + pos + 12)
            blen = rd32(b + pos + 16)
            if total < C_BATCH_HEAD + 2 or pos + total > n or blen < 0 or blen > total - C_BATCH_HEAD - 2 \
                    or blen > max_body:
                return None
            bp = pos + C_BATCH_HEAD
            p = bp + blen
            plen = <int16_t>((b[p] << 8) | b[p + 1])
            p += 2
            if plen < 0 or p + plen != pos + total:
                return None
            pos += total
            try:
                PyUnicode_DecodeUTF8(<const char*>b + p, plen, NULL)
            except UnicodeDecodeError:
                return None
            tags = keys = uniq = None
            dedup = False
            nnames = 0
            closed = plen == 0 or b[p + plen - 1] == 2
            if plen:
                lim = p + plen - 1 if b[p + plen - 1] == 2 else p + plen
                i = p
                while True:  # the pieces of b[p:lim] split on 0x02 (one empty piece when lim == p)
                    q = <const uint8_t*>memchr(b + i, 2, lim - i) if i < lim else NULL
                    j = (q - b) if q != NULL else lim
                    q = <const uint8_t*>memchr(b + i, 1, j - i) if i < j else NULL
                    if q == NULL or q == b + i:
                        return None
                    s = q - b
                    if s + 1 < j and memchr(b + s + 1, 1, j - s - 1) != NULL:
                        return None
                    if nnames == C_ITEM_NAMES:
                        return None
                    for k in range(nnames):
                        if name_len[k] == s - i and memcmp(b + name_at[k], b + i, s - i) == 0:
                            return None
                    for k in range(nspecial):
                        if _named(b + i, s - i, <bytes>special[k]):
                            return None
                    name_at[nnames] = i
                    name_len[nnames] = s - i
                    nnames += 1
                    if _named(b + i, s - i, _N_TAGS):
                        tags = PyUnicode_DecodeUTF8(<const char*>b + s + 1, j - s - 1, NULL)
                    elif _named(b + i, s - i, _N_KEYS):
                        keys = PyUnicode_DecodeUTF8(<const char*>b + s + 1, j - s - 1, NULL)
                    elif _named(b + i, s - i, _N_UNIQ):
                        uniq = PyUnicode_DecodeUTF8(<const char*>b + s + 1, j - s - 1, NULL)
                    elif _named(b + i, s - i, _N_DEDUP):
                        dedup = j - s - 1 == 4 and memcmp(b + s + 1, b"true", 4) == 0
                    if j >= lim:
                        break
                    i = j + 1
            pl = plen + (0 if closed else 1) + sl
            if pl > C_MAX_PROPS:
                return None
            size = C_FIXED + blen + tl + pl
            if size > max_record:
                return None
            rec = PyBytes_FromStringAndSize(NULL, size)
            o = <uint8_t*>PyBytes_AS_STRING(rec)
            crc = cmq_crc32(b + bp, blen, 0)
            wr32(o, size)
            wr32(o + 4, C_MAGIC)
            wr32(o + 8, crc & 0x7FFFFFFF)
            wr32(o + 12, queue_id)
            wr32(o + 16, flag)
            memset(o + 20, 0, 16)  # queue offset, physical offset: patched by the append
            wr32(o + 36, sys_flag & C_HOST_MASK)
            wr64(o + 40, born_ts)
            memset(o + 48, 0, 8)
            memcpy(o + 48, PyBytes_AS_STRING(born_host_b), hl)
            memset(o + 56, 0, 16)  # store timestamp (patched), store host
            memcpy(o + 64, PyBytes_AS_STRING(store_host_b), shl)
            wr32(o + 72, reconsume)
            memset(o + 76, 0, 8)  # prepared transaction offset
            wr32(o + 84, blen)
            memcpy(o + C_BODY, b + bp, blen)
            w = C_BODY + blen
            o[w] = <uint8_t>tl
            memcpy(o + w + 1, PyBytes_AS_STRING(topic_b), tl)
            w += 1 + tl
            o[w] = (pl >> 8) & 0xFF
            o[w + 1] = pl & 0xFF
            w += 2
            memcpy(o + w, b + p, plen)
            w += plen
            if not closed:
                o[w] = 2
                w += 1
            memcpy(o + w, PyBytes_AS_STRING(stamps_b), sl)
            keys_l = [x for x in keys.split(" ") if x] if keys else None
            h = tag_cache[tags] if tags else 0
            e = PyType_GenericAlloc(<PyTypeObject*>etype, 5)
            _set(e, 0, rec)
            _set(e, 1, h)
            _set(e, 2, None)
            _set(e, 3, keys_l)
            _set(e, 4, uniq)
            entries.append(e)
            ask = uniq if dedup and uniq else None
            if ask is not None:
                asked = True
            asks.append(ask)
            bodies += blen
        return entries, (asks if asked else None), bodies
    finally:
        PyBuffer_Release(&view)


# --- the timer's schedule path (chronomq.delay.timer: append.pack_timer_records, append.pack_index_entries,
# files.pack_hash_entries); its layouts are little-endian (records.DATA_HDR, records.IDX, files.HASH_ENTRY)
cdef int32_t C_TIMER_MAGIC = 0x54494D52  # records.DATA_MAGIC
cdef int64_t C_TIMER_OFFSET_FLAG = 1 << 62  # records.TIMER_OFFSET_FLAG
cdef Py_ssize_t C_TIMER_HDR = 64  # records.DATA_HDR_SIZE
cdef Py_ssize_t C_IDX_BODY = 44  # records._IDX_BODY.size; the entry adds a 4-byte CRC
cdef Py_ssize_t C_HASH_ENTRY = 20  # files.HASH_ENTRY.size
cdef Py_ssize_t C_PAGE = 4096  # mapped.BackedPages.PAGE
cdef int64_t C_TWO31 = 2147483648  # the stored CRC fields hold crc32 - 2**31 (a signed 32-bit int)
cdef inline void wl32(uint8_t* p, int64_t v) noexcept nogil:
    p[0] = v & 0xFF
    p[1] = (v >> 8) & 0xFF
    p[2] = (v >> 16) & 0xFF
    p[3] = (v >> 24) & 0xFF


cdef inline void wl64(uint8_t* p, int64_t v) noexcept nogil:
    wl32(p, v)
    wl32(p + 4, v >> 32)


cdef inline int64_t rl64(const uint8_t* p) noexcept nogil:
    cdef uint64_t v = 0
    cdef int i
    for i in range(7, -1, -1):
        v = (v << 8) | p[i]
    return <int64_t>v


cdef inline uint8_t* _grow(bytearray buf, Py_ssize_t extra) except NULL:
    """Make room for ``extra`` more bytes at the end of ``buf``; returns where they start."""
    cdef Py_ssize_t n = PyByteArray_GET_SIZE(buf)
    if PyByteArray_Resize(buf, n + extra) < 0:
        return NULL
    return <uint8_t*>PyByteArray_AS_STRING(buf) + n


# the CRC-32 of the key prefixes "u:" (UNIQ_KEY) and "k:" (KEYS), computed once
cdef uint32_t _U_SEED = cmq_crc32_bytes(<const uint8_t*>b"u:", 2, 0)
cdef uint32_t _K_SEED = cmq_crc32_bytes(<const uint8_t*>b"k:", 2, 0)


cdef inline int64_t _key_hash(uint32_t seed, str text) except -1:
    """files.key_hash(prefix + text), the prefix's CRC given as ``seed``: the CRC-32 of the UTF-8 bytes,
    31 bits."""
    cdef Py_ssize_t n
    cdef const char* t = PyUnicode_AsUTF8AndSize(text, &n)
    return cmq_crc32_bytes(<const uint8_t*>t, n, seed) & 0x7FFFFFFF


def pack_timer_records(list encoded, dict tids, int64_t now, int64_t origin, int64_t pos, int64_t seg_size,
                       list placed, list hash_items, list results, object result_cls, str id_prefix):
    """append.pack_timer_records: the data log bytes of ``encoded`` from ``pos``, with ``placed``, the key
    hash entries and the results appended; returns the writes [(position, bytes)] and the end."""
    cdef list writes = []
    cdef bytearray chunk = bytearray()
    cdef int64_t chunk_pos = pos, size, deliver, tid, p, crc
    cdef Py_buffer rv
    cdef uint8_t* o
    cdef object msg, deliver_o, rec, props, keys
    cdef str uniq, k
    cdef char hexbuf[16]
    cdef int j
    for e in encoded:
        msg, deliver_o, rec = e
        deliver = deliver_o
        tid = tids[msg.topic]
        PyObject_GetBuffer(rec, &rv, PyBUF_SIMPLE)
        try:
            size = C_TIMER_HDR + rv.len
            if seg_size - pos % seg_size < size:
                if PyByteArray_GET_SIZE(chunk):
                    writes.append((chunk_pos, chunk))
                    chunk = bytearray()
                pos = pos - pos % seg_size + seg_size
                chunk_pos = pos
            crc = cmq_crc32(<const uint8_t*>rv.buf, rv.len, 0)
            o = _grow(chunk, size)
            wl32(o, C_TIMER_MAGIC)
            wl32(o + 4, size)
            wl32(o + 8, 0)  # PENDING
            wl32(o + 12, 0)  # generation
            wl64(o + 16, deliver)
            wl64(o + 24, 0)  # done_ms
            wl64(o + 32, now)
            wl64(o + 40, origin)
            wl64(o + 48, 0)  # done_seq
            wl32(o + 56, crc - C_TWO31)
            wl32(o + 60, tid)
            memcpy(o + C_TIMER_HDR, rv.buf, rv.len)
        finally:
            PyBuffer_Release(&rv)
        placed.append((pos, size, deliver_o, tid))
        props = msg.properties
        uniq = props[PROPERTY_UNIQ_KEY]
        hash_items.append((_key_hash(_U_SEED, uniq), pos))
        keys = props.get(PROPERTY_KEYS)
        if keys:
            for k in keys.split(" "):
                if k:
                    hash_items.append((_key_hash(_K_SEED, k), pos))
        p = C_TIMER_OFFSET_FLAG | pos
        for j in range(16):
            hexbuf[15 - j] = b"0123456789ABCDEF"[(p >> (4 * j)) & 0xF]
        results.append(result_cls(uniq, id_prefix + PyUnicode_DecodeASCII(hexbuf, 16, NULL), deliver_o, pos))
        pos += size
    if PyByteArray_GET_SIZE(chunk):
        writes.append((chunk_pos, chunk))
    return writes, pos


def pack_index_entries(list links, int64_t floor, int64_t slot_ms, int64_t start_idx, int64_t per_seg,
                       dict seg_max, int64_t hot, object wheel_get):
    """append.pack_index_entries: the index entries of ``links`` from ``start_idx``, linked into their
    slots; returns (bytes, new heads, in-memory items, earliest deliver time)."""
    cdef dict heads = {}
    cdef bytearray buf = bytearray()
    cdef list items = []
    cdef object min_deliver = None, prev_o, m
    cdef int64_t deliver, pos, gen, tid, size, slot, prev, idx = start_idx, seg, best = 0
    cdef uint8_t* o
    cdef bint any_ = False
    for e in links:
        deliver, pos, gen, tid, size = e
        slot = deliver // slot_ms
        if slot < floor:
            slot = floor
        prev_o = heads.get(slot)
        prev = wheel_get(slot) if prev_o is None else prev_o
        o = _grow(buf, C_IDX_BODY + 4)
        wl64(o, deliver)
        wl64(o + 8, pos)
        wl64(o + 16, prev)
        wl64(o + 24, slot)
        wl32(o + 32, gen)
        wl32(o + 36, tid)
        wl32(o + 40, size)
        wl32(o + 44, <int64_t>cmq_crc32_bytes(o, C_IDX_BODY, 0) - C_TWO31)
        heads[slot] = idx + 1
        seg = idx // per_seg
        m = seg_max.get(seg)
        if m is None or slot > m:
            seg_max[seg] = slot
        if slot <= hot:
            items.append((slot, (deliver, idx, pos, gen, tid, size)))
        if not any_ or deliver < best:
            best = deliver
            any_ = True
        idx += 1
    if any_:
        min_deliver = best
    return buf, heads, items, min_deliver


def pack_hash_entries(list items, int64_t count, int64_t buckets, object bmap, set backed):
    """files.pack_hash_entries: the hash entries of ``items`` numbered from ``count`` + 1, linked into
    their buckets; returns (bytes, new heads, highest position)."""
    cdef dict heads = {}
    cdef bytearray buf = bytearray()
    cdef int64_t h, pos, b, prev, n = count, max_pos = -1
    cdef object prev_o
    cdef Py_buffer view
    cdef uint8_t* o
    PyObject_GetBuffer(bmap, &view, PyBUF_SIMPLE)
    try:
        for e in items:
            h, pos = e
            b = (h % buckets) * 8
            prev_o = heads.get(b)
            if prev_o is not None:
                prev = prev_o
            elif b // C_PAGE in backed and b + 8 <= view.len:
                prev = rl64(<const uint8_t*>view.buf + b)
            else:
                prev = 0
            o = _grow(buf, C_HASH_ENTRY)
            wl32(o, h)
            wl64(o + 4, pos)
            wl64(o + 12, prev)
            n += 1
            heads[b] = n
            if pos > max_pos:
                max_pos = pos
    finally:
        PyBuffer_Release(&view)
    return buf, heads, max_pos


cdef int32_t C_DELIVERED = 1  # records.DELIVERED
cdef Py_ssize_t C_STATE_BLOCK = 48  # records._STATE_BLOCK.size


def mark_delivered_run(list group, object t, int64_t seq, dict marks, bytearray buf, object pending,
                       dict lates, list out):
    """window.mark_delivered_run: the delivery marks of ``group`` at ``t``, numbered on from ``seq``;
    returns the last number. The objects the group holds (positions, topic ids) and ``t`` are reused as
    they are: converting them to C and back cost more than the twin's whole loop."""
    cdef object e, h, item, pos, tid, lk
    cdef int64_t tc = t
    cdef int64_t d, created
    cdef Py_ssize_t n = len(group), i, start, filled = 0
    cdef bytes block
    cdef uint8_t* o
    cdef uint8_t* b
    if n == 0:
        return seq
    start = PyByteArray_GET_SIZE(buf)
    o = _grow(buf, n * (8 + C_STATE_BLOCK))
    i = 0
    try:
        while i < n:
            e = group[i]
            if not PyTuple_Check(e) or PyTuple_GET_SIZE(e) < 4:
                raise TypeError("mark_delivered_run: a group entry is not a Taken")
            h = <object>PyTuple_GET_ITEM(e, 2)
            item = <object>PyTuple_GET_ITEM(e, 3)
            if (not PyTuple_Check(h) or PyTuple_GET_SIZE(h) < 8 or not PyTuple_Check(item)
                    or PyTuple_GET_SIZE(item) < 5):
                raise TypeError("mark_delivered_run: a group entry's header or item is malformed")
            pos = <object>PyTuple_GET_ITEM(item, 2)
            tid = <object>PyTuple_GET_ITEM(item, 4)
            seq += 1
            created = <object>PyTuple_GET_ITEM(h, 6)
            block = PyBytes_FromStringAndSize(NULL, C_STATE_BLOCK)
            b = <uint8_t*>PyBytes_AS_STRING(block)
            wl32(b, C_DELIVERED)
            wl32(b + 4, <object>PyTuple_GET_ITEM(h, 3))
            wl64(b + 8, <object>PyTuple_GET_ITEM(h, 4))
            wl64(b + 16, tc)
            wl64(b + 24, created)
            wl64(b + 32, <object>PyTuple_GET_ITEM(h, 7))
            wl64(b + 40, seq)
            marks[pos] = (C_DELIVERED, t, seq, block)
            wl64(o, pos)
            memcpy(o + 8, b, C_STATE_BLOCK)
            o += 8 + C_STATE_BLOCK
            filled += 1
            pending[tid] -= 1
            d = <object>PyTuple_GET_ITEM(item, 0)
            lk = (tid, tc - (d if d > created else created))
            lates[lk] = lates.get(lk, 0) + 1
            out[<Py_ssize_t><object>PyTuple_GET_ITEM(e, 0)] = "delivered"
            i += 1
    finally:
        if filled < n:  # a failure: the buffer keeps the entries written, as the twin's does
            PyByteArray_Resize(buf, start + filled * (8 + C_STATE_BLOCK))
    return seq


def index_entries(object mm, Py_ssize_t entries_at, Py_ssize_t allocated, bytearray slots,
                  Py_ssize_t slot_num, Py_ssize_t n, Py_ssize_t index_num, int64_t begin_ts, list items,
                  Py_ssize_t i, Py_ssize_t w, set dirty):
    """index.index_entries_py. The caller's sizes are trusted for the results (allocated within the
    mapping, the slot table ``slot_num`` slots long) and checked for memory safety only (ValueError)."""
    cdef Py_buffer v
    cdef uint8_t* base
    cdef uint8_t* sl
    cdef Py_ssize_t count = len(items), nwords, epos, slot_pos, used = 0, tlen, wlen, limit
    cdef int64_t phys = -1, ts = 0, e_phys, e_ts, tdiff, begin_phy = -1
    cdef int32_t prev
    cdef uint32_t h, th = 0
    cdef const char* tp
    cdef const char* wp
    cdef object req, uniq, keys, word
    cdef bint has_uniq
    if slot_num <= 0 or PyByteArray_GET_SIZE(slots) < slot_num * 4:
        raise ValueError("the slot table is shorter than slot_num slots")
    sl = <uint8_t*>PyByteArray_AS_STRING(slots)
    PyObject_GetBuffer(mm, &v, PyBUF_WRITABLE)
    try:
        base = <uint8_t*>v.buf
        limit = allocated if allocated < v.len else v.len
        while i < count:
            req = items[i]
            uniq = req.uniq_key
            keys = req.keys
            has_uniq = bool(uniq)
            nwords = (1 if has_uniq else 0) + (len(keys) if keys else 0)
            if w < nwords:
                e_phys = req.phys
                e_ts = req.store_timestamp
                tp = PyUnicode_AsUTF8AndSize(req.topic, &tlen)
                th = cmq_crc32(<const uint8_t*>b"#", 1, cmq_crc32(<const uint8_t*>tp, tlen, 0))  # "topic#"
            while w < nwords:
                epos = entries_at + n * 20
                if n >= index_num or epos < 0 or epos + 20 > limit:
                    return n, used, i, w, begin_ts, begin_phy, phys, ts
                if n == 1:
                    begin_ts = e_ts
                    begin_phy = e_phys
                word = uniq if (has_uniq and w == 0) else keys[w - 1 if has_uniq else w]
                wp = PyUnicode_AsUTF8AndSize(word, &wlen)
                h = cmq_crc32(<const uint8_t*>wp, wlen, th) & 0x7FFFFFFF
                slot_pos = (h % slot_num) * 4
                prev = rd32(sl + slot_pos)
                if prev <= 0 or prev >= n:
                    prev = 0
                    used += 1
                if e_ts < begin_ts:
                    tdiff = 0
                else:
                    tdiff = (e_ts - begin_ts) // 1000
                    if tdiff > 0x7FFFFFFF:
                        tdiff = 0x7FFFFFFF
                wr32(base + epos, h)
                wr64(base + epos + 4, e_phys)
                wr32(base + epos + 12, tdiff)
                wr32(base + epos + 16, prev)
                wr32(sl + slot_pos, n)
                dirty.add(slot_pos >> 12)
                n += 1
                w += 1
                phys = e_phys
                ts = e_ts
            i += 1
            w = 0
    finally:
        PyBuffer_Release(&v)
    return n, used, i, w, begin_ts, begin_phy, phys, ts


cdef struct _IndexFileView:
    const uint8_t* base  # the mapping (NULL: closed, passed over)
    Py_ssize_t size
    const uint8_t* slots  # the slot table in memory (NULL: read with pread)
    int fd
    int64_t slot_num
    int64_t entries_at
    int64_t count
    int64_t lo_s  # the window in seconds since the file's begin time, widened by one each way
    int64_t hi_s


cdef int64_t C_HEADER = 40  # index.HEADER_SIZE
cdef int64_t C_ENTRY = 20  # index.ENTRY_SIZE


cdef inline int64_t rd64(const uint8_t* p) noexcept nogil:
    return <int64_t>((<uint64_t><uint32_t>rd32(p) << 32) | <uint32_t>rd32(p + 4))


cdef int _pread_slot(int fd, int64_t off, int32_t* n) noexcept:
    """os.pread(fd, 4, off) as index_query_py reads a slot into ``n`` (0 from a short read); -1 when it
    fails (the file was closed meanwhile)."""
    cdef uint8_t b[4]
    cdef ssize_t r
    while True:
        r = pread(fd, b, 4, off)
        if r >= 0 or errno != EINTR:
            break
    if r < 0:
        return -1
    n[0] = rd32(b) if r == 4 else 0
    return 0


cdef inline int64_t _window_s(object v) except? -1:
    """(ts - begin) // 1000 -+ 1 as index_query_py computes it, clamped to where it compares with an int32
    seconds field the same way."""
    if v < -(1 << 40):
        return -(1 << 40)
    if v > (1 << 40):
        return 1 << 40
    return <int64_t>v


def index_query(str topic, list keys, list files, Py_ssize_t limit, object begin_ts, object end_ts):
    """index.index_query_py. The mapping is held (its buffer) for the whole call, which keeps the GIL: no
    other thread closes it meanwhile."""
    cdef Py_ssize_t nf = len(files), k, j, tlen, wlen, got
    cdef _IndexFileView* fv
    cdef Py_buffer* bufs
    cdef _IndexFileView* f
    cdef const char* tp
    cdef const char* wp
    cdef uint32_t th, h
    cdef int32_t n, eh, tdiff, prev
    cdef int64_t seen, epos
    cdef dict out = {}
    cdef list found
    cdef object t, mm, slots, key
    for t in files:
        slots = t[2]
        if t[3] <= 0 or (slots is not None and len(slots) < t[3] * 4):
            raise ValueError("the slot table is shorter than slot_num slots")
    if nf == 0 or not keys:
        return out
    fv = <_IndexFileView*>PyMem_Calloc(nf, sizeof(_IndexFileView))
    bufs = <Py_buffer*>PyMem_Calloc(nf, sizeof(Py_buffer))
    if fv == NULL or bufs == NULL:
        PyMem_Free(fv)
        PyMem_Free(bufs)
        raise MemoryError()
    try:
        for j in range(nf):
            t = files[j]
            mm, slots = t[0], t[2]
            f = &fv[j]
            f.fd = t[1]
            f.slot_num = t[3]
            f.entries_at = t[4]
            f.count = t[5]
            f.lo_s = _window_s((begin_ts - t[6]) // 1000 - 1)
            f.hi_s = _window_s((end_ts - t[6]) // 1000 + 1)
            if slots is not None:
                if not isinstance(slots, bytearray):
                    raise TypeError("a slot table is a bytearray")
                f.slots = <const uint8_t*>PyByteArray_AS_STRING(slots)
            try:
                PyObject_GetBuffer(mm, &bufs[j], PyBUF_SIMPLE)
            except ValueError:
                continue  # the mapping is closed
            f.base = <const uint8_t*>bufs[j].buf
            f.size = bufs[j].len
        tp = PyUnicode_AsUTF8AndSize(topic, &tlen)
        th = cmq_crc32(<const uint8_t*>b"#", 1, cmq_crc32(<const uint8_t*>tp, tlen, 0))  # "topic#"
        for key in keys:
            wp = PyUnicode_AsUTF8AndSize(key, &wlen)
            h = cmq_crc32(<const uint8_t*>wp, wlen, th) & 0x7FFFFFFF
            found = None
            got = 0
            for j in range(nf):
                if got >= limit:
                    break
                f = &fv[j]
                if f.slots != NULL:
                    n = rd32(f.slots + (h % f.slot_num) * 4)
                else:
                    if _pread_slot(f.fd, C_HEADER + (h % f.slot_num) * 4, &n) < 0:
                        continue
                if not (0 < n and n < f.count) or f.base == NULL:
                    continue
                seen = 0
                while 0 < n and n < f.count and got < limit and seen < f.count:
                    epos = f.entries_at + <int64_t>n * C_ENTRY
                    if epos < 0 or epos + C_ENTRY > f.size:
                        break
                    eh = rd32(f.base + epos)
                    tdiff = rd32(f.base + epos + 12)
                    prev = rd32(f.base + epos + 16)
                    seen += 1
                    if tdiff < f.lo_s:
                        break  # chains run newest to oldest
                    if <uint32_t>eh == h and tdiff <= f.hi_s:
                        if found is None:
                            found = []
                        found.append(rd64(f.base + epos + 4))
                        got += 1
                    if prev >= n:
                        break
                    n = prev
            if found is not None:
                out[key] = found
    finally:
        for j in range(nf):
            if fv[j].base != NULL:
                PyBuffer_Release(&bufs[j])
        PyMem_Free(fv)
        PyMem_Free(bufs)
    return out


# --- the timer's retention scan (delay/timer/retention.scan_records_py) ---------------------------------
cdef inline int32_t rl32(const uint8_t* p) noexcept nogil:
    return <int32_t>(<uint32_t>p[0] | (<uint32_t>p[1] << 8) | (<uint32_t>p[2] << 16) | (<uint32_t>p[3] << 24))


def scan_records(object buf, int64_t buf_at, Py_ssize_t have, int64_t pos, int64_t stop, Py_ssize_t limit,
                 dict marks, int64_t done_seq, list open_ranges, int64_t min_run, list st, list runs):
    """retention.scan_records_py: walk the timer's data record headers in ``buf`` from ``pos`` (see the
    twin for ``st`` and the result)."""
    cdef Py_buffer view
    cdef const uint8_t* b
    cdef const uint8_t* p
    cdef Py_ssize_t n = 0, nr = len(open_ranges), k
    cdef int64_t* rl = NULL
    cdef int64_t best = 0, run_first, run_new, waiting, size, seq, deliver, limit_end
    cdef int32_t state
    cdef bint has_best, ok, ended = False
    cdef object r
    if len(st) < 4:
        raise ValueError("scan_records: st holds best, run first, run new and waiting")
    has_best = st[0] is not None
    if has_best:
        best = st[0]
    run_first, run_new, waiting = st[1], st[2], st[3]
    if nr:
        rl = <int64_t*>PyMem_Malloc(nr * 2 * sizeof(int64_t))
        if rl == NULL:
            raise MemoryError()
    PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE)
    try:
        for k in range(nr):
            r = open_ranges[k]
            rl[2 * k] = r[0]
            rl[2 * k + 1] = r[1]
        if have > view.len:
            have = view.len
        b = <const uint8_t*>view.buf
        limit_end = buf_at + have
        while n < limit and pos < stop and pos >= buf_at and pos + C_TIMER_HDR <= limit_end:
            p = b + (pos - buf_at)
            size = rl32(p + 4)
            if rl32(p) != C_TIMER_MAGIC or size < C_TIMER_HDR:
                ended = True
                break
            state = rl32(p + 8)
            if state == 0:  # records.PENDING
                deliver = rl64(p + 16)
                if (not has_best or deliver > best) and not PyDict_Contains(marks, pos):
                    best = deliver
                    has_best = True
                ok = False
            else:
                seq = rl64(p + 48)
                ok = seq <= done_seq
                if ok:
                    for k in range(nr):
                        if rl[2 * k] < seq < rl[2 * k + 1]:
                            ok = False
                            break
            if ok:
                if run_first < 0:
                    run_first = run_new = pos
            else:
                if state != 0:
                    waiting += 1
                if run_first >= 0 and pos - run_new >= min_run:
                    runs.append((run_first, pos))
                run_first = -1
            pos += size
            n += 1
    finally:
        PyBuffer_Release(&view)
        PyMem_Free(rl)
    st[0] = best if has_best else None
    st[1] = run_first
    st[2] = run_new
    st[3] = waiting
    return pos, n, ended
