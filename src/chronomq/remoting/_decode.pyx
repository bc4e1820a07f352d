# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The client's decode of a pull answer (RocketMQ's stored V1 records, concatenated), compiled: each
function is a drop-in for its pure-Python twin in chronomq.client.model (record_columns_py,
decode_received_py, parse_properties_py), with the same results, the same refusals (MessageFormatError,
zlib.error) and the same messages. The client's classes come in as arguments, since remoting/ does not
import client/. chronomq.remoting.decode chooses between this module and the twins; _decode.pyi gives
mypy its types."""

import types
import zlib

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_FromStringAndSize, PyByteArray_Resize
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.dict cimport PyDict_GetItem, PyDict_SetItem
from cpython.ref cimport PyObject, Py_INCREF
from cpython.unicode cimport PyUnicode_DecodeASCII, PyUnicode_DecodeUTF8
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.stdio cimport snprintf
from libc.string cimport memchr, memcmp, memcpy


cdef extern from "Python.h":
    ctypedef struct PyTypeObject:
        Py_ssize_t tp_basicsize
    object PyType_GenericAlloc(PyTypeObject* t, Py_ssize_t n)
    Py_ssize_t PyUnicode_FindChar(object s, Py_UCS4 ch, Py_ssize_t start, Py_ssize_t end,
                                  int direction) except -2
    object PyUnicode_Substring(object s, Py_ssize_t start, Py_ssize_t end)
    ctypedef struct PyMemberDef:
        int type
        Py_ssize_t offset
        int flags
    ctypedef struct PyMemberDescrObject:
        PyMemberDef* d_member


cdef extern from "structmember.h":
    int T_OBJECT_EX
    int READONLY


# The V1 record layout and the names the decode reads (chronomq.message; a test checks they agree).
# Nothing is imported from chronomq at load time, so loading this module never depends on import order.
DEF_MAGIC_V1 = 0xDAA320A7 - (1 << 32)
RECORD_FIXED_SIZE = 91
POS_BODY = 88
SYSFLAG_COMPRESSED = 0x1
PROPERTY_UNIQ_KEY = "UNIQ_KEY"
PROPERTY_RETRY_TOPIC = "RETRY_TOPIC"
RETRY_GROUP_TOPIC_PREFIX = "%RETRY%"
# ReceivedMessage's fields, as decode_received fills them (a test checks they are the class's fields)
RECEIVED_FIELDS = ("topic", "body", "id", "queue", "queue_offset", "commit_log_offset", "properties",
                   "reconsume_times", "born_timestamp", "store_timestamp", "born_host", "store_host", "flag",
                   "sys_flag", "store_size", "raw_topic")

cdef int32_t C_MAGIC = DEF_MAGIC_V1
cdef Py_ssize_t C_FIXED = RECORD_FIXED_SIZE
cdef Py_ssize_t C_BODY = POS_BODY
cdef int32_t C_COMPRESSED = SYSFLAG_COMPRESSED
cdef bytes C_RETRY_PREFIX = RETRY_GROUP_TOPIC_PREFIX.encode()
cdef Py_ssize_t C_RETRY_LEN = len(C_RETRY_PREFIX)
cdef str C_UNIQ = PROPERTY_UNIQ_KEY
cdef str C_RETRY_TOPIC = PROPERTY_RETRY_TOPIC
cdef Py_ssize_t KEEP = 32  # property items (by position in a record) whose name and value are kept for reuse
cdef Py_ssize_t MAX_HOSTS = 10_000  # distinct hosts kept decoded (the cache is emptied past it)

cdef object _error_cls = None
cdef object _decompress = zlib.decompress
cdef dict _hosts = {}  # the 8 stored bytes (as an int) -> (ip, port)
cdef dict _layouts = {}  # a ReceivedMessage class -> its _Layout


cdef object _format_error(str text):
    global _error_cls
    if _error_cls is None:
        from chronomq.message import MessageFormatError
        _error_cls = MessageFormatError
    return _error_cls(text)


cdef inline int32_t rd32(const uint8_t* p) noexcept nogil:
    return <int32_t>((<uint32_t>p[0] << 24) | (<uint32_t>p[1] << 16) | (<uint32_t>p[2] << 8) | p[3])


cdef inline int64_t rd64(const uint8_t* p) noexcept nogil:
    return <int64_t>((<uint64_t><uint32_t>rd32(p) << 32) | <uint32_t>rd32(p + 4))


cdef inline uint64_t rdu64(const uint8_t* p) noexcept nogil:
    return (<uint64_t><uint32_t>rd32(p) << 32) | <uint32_t>rd32(p + 4)


# --- one record's fields, checked in the order the pure decode checks them ------------------------------

cdef struct Rec:
    int32_t total, queue_id, flag, sys_flag, reconsume
    int64_t queue_offset, phys, born_ts, store_ts
    Py_ssize_t body, body_len, topic, topic_len, props, props_len, end


cdef class _Last:
    """A str decoded from bytes of the buffer, kept while the next bytes are the same (a batch repeats its
    topic, and its records' property names and many values)."""
    cdef const uint8_t* ptr
    cdef Py_ssize_t size
    cdef object text

    cdef inline object get(self, const uint8_t* p, Py_ssize_t size):
        if self.text is not None and size == self.size and memcmp(p, self.ptr, size) == 0:
            return self.text
        text = PyUnicode_DecodeUTF8(<const char*>p, size, NULL)
        self.ptr = p
        self.size = size
        self.text = text
        return text


cdef object _record(const uint8_t* b, Py_ssize_t n, Py_ssize_t pos, Rec* r, _Last topics):
    """The record at ``pos``: its fields into ``r`` (the body's, topic's and properties' bounds too) and its
    topic, decoded (cut at the buffer's end, as a slice is)."""
    cdef int32_t magic, body_len
    cdef Py_ssize_t p
    if n - pos < C_FIXED:
        raise _format_error("record truncated")
    r.total = rd32(b + pos)
    magic = rd32(b + pos + 4)
    if magic != C_MAGIC:
        raise _format_error(f"bad magic code {(<int64_t>magic) & 0xFFFFFFFF:#x}")
    r.end = pos + r.total
    if r.total < C_FIXED or r.end > n:
        raise _format_error("record length out of range")
    body_len = rd32(b + pos + C_BODY - 4)
    p = pos + C_BODY
    if body_len < 0 or p + body_len + 3 > r.end:
        raise _format_error("body length out of range")
    r.queue_id = rd32(b + pos + 12)
    r.flag = rd32(b + pos + 16)
    r.queue_offset = rd64(b + pos + 20)
    r.phys = rd64(b + pos + 28)
    r.sys_flag = rd32(b + pos + 36)
    r.born_ts = rd64(b + pos + 40)
    r.store_ts = rd64(b + pos + 56)
    r.reconsume = rd32(b + pos + 72)
    r.body = p
    r.body_len = body_len
    p += body_len
    r.topic = p + 1
    r.topic_len = b[p]
    try:
        topic = topics.get(b + r.topic, min(r.topic_len, n - r.topic))
    except UnicodeDecodeError as e:
        raise _format_error("topic is not UTF-8") from e
    p = r.topic + r.topic_len
    if p + 2 > r.end:
        raise _format_error("properties length out of range")
    r.props_len = (<Py_ssize_t>b[p] << 8) | b[p + 1]
    r.props = p + 2
    if r.props + r.props_len != r.end:
        raise _format_error("record length does not match its fields")
    return topic


cdef object _body(const uint8_t* b, Rec* r):
    body = PyBytes_FromStringAndSize(<const char*>b + r.body, r.body_len)
    if r.sys_flag & C_COMPRESSED:
        body = _decompress(body)
    return body


# --- record_columns ---------------------------------------------------------------------------------------

def record_columns(object buf, object cls):
    """model.record_columns_py: the records of a pull answer field by field, as
    ``cls(queue_ids, flags, queue_offsets, commit_log_offsets, sys_flags, born_timestamps, born_hosts,
    store_timestamps, store_hosts, reconsume_times, store_sizes, bodies, topics, properties)`` (bodies
    inflated, sys flags without the compressed bit, hosts the 8 stored bytes, properties their text).
    Raises MessageFormatError (zlib.error for a compressed body that does not inflate)."""
    cdef Py_buffer view
    cdef const uint8_t* b
    cdef Py_ssize_t n, pos = 0
    cdef Rec r
    cdef _Last topics_seen = _Last()
    cdef list queue_ids = [], flags = [], queue_offsets = [], commit_log_offsets = [], sys_flags = []
    cdef list born_timestamps = [], born_hosts = [], store_timestamps = [], store_hosts = []
    cdef list reconsume_times = [], store_sizes = [], bodies = [], topics = [], properties = []
    PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE)
    try:
        b = <const uint8_t*>view.buf
        n = view.len
        while pos < n:
            topic = _record(b, n, pos, &r, topics_seen)
            try:
                text = PyUnicode_DecodeUTF8(<const char*>b + r.props, r.props_len, NULL)
            except UnicodeDecodeError as e:
                raise _format_error("properties are not UTF-8") from e
            bodies.append(_body(b, &r))
            topics.append(topic)
            properties.append(text)
            queue_ids.append(r.queue_id)
            flags.append(r.flag)
            queue_offsets.append(r.queue_offset)
            commit_log_offsets.append(r.phys)
            sys_flags.append(r.sys_flag & ~C_COMPRESSED)
            born_timestamps.append(r.born_ts)
            born_hosts.append(PyBytes_FromStringAndSize(<const char*>b + pos + 48, 8))
            store_timestamps.append(r.store_ts)
            store_hosts.append(PyBytes_FromStringAndSize(<const char*>b + pos + 64, 8))
            reconsume_times.append(r.reconsume)
            store_sizes.append(r.total)
            pos = r.end
    finally:
        PyBuffer_Release(&view)
    return cls(queue_ids, flags, queue_offsets, commit_log_offsets, sys_flags, born_timestamps, born_hosts,
               store_timestamps, store_hosts, reconsume_times, store_sizes, bodies, topics, properties)


# --- properties -------------------------------------------------------------------------------------------

cdef dict _props_of(const uint8_t* p, Py_ssize_t n, list names, list values):
    """parse_properties over UTF-8 bytes: items split on 0x02, name and value on the first 0x01; items
    without a separator or with an empty name are skipped; a later name wins. Splitting the bytes equals
    splitting the decoded text: 0x01 and 0x02 never occur inside a multi-byte UTF-8 sequence, and the pieces
    are valid UTF-8 exactly when the whole is (a skipped piece is decoded too, for that check). ``names``
    and ``values``: the _Last of each item position, shared by the records of one answer."""
    cdef dict props = {}
    cdef Py_ssize_t i = 0, j, s, item = 0
    cdef const uint8_t* q
    if n == 0:
        return props
    while i <= n:
        q = <const uint8_t*>memchr(p + i, 2, n - i) if i < n else NULL
        j = (q - p) if q != NULL else n
        if j > i:
            q = <const uint8_t*>memchr(p + i, 1, j - i)
            if q == NULL:
                PyUnicode_DecodeUTF8(<const char*>p + i, j - i, NULL)
            else:
                s = q - p
                if s == i:
                    PyUnicode_DecodeUTF8(<const char*>p + s + 1, j - s - 1, NULL)
                elif item < KEEP:
                    if item == len(names):
                        names.append(_Last())
                        values.append(_Last())
                    PyDict_SetItem(props, (<_Last>names[item]).get(p + i, s - i),
                                   (<_Last>values[item]).get(p + s + 1, j - s - 1))
                    item += 1
                else:
                    PyDict_SetItem(props, PyUnicode_DecodeUTF8(<const char*>p + i, s - i, NULL),
                                   PyUnicode_DecodeUTF8(<const char*>p + s + 1, j - s - 1, NULL))
        i = j + 1
    return props


def parse_properties(str text):
    """model.parse_properties_py: stored property text -> dict (an item without a name or a separator is
    skipped; the last wins)."""
    cdef dict props = {}
    cdef Py_ssize_t n, i = 0, j, s
    if not text:
        return props
    n = len(text)
    while i <= n:
        j = PyUnicode_FindChar(text, 2, i, n, 1) if i < n else -1
        if j == -1:
            j = n
        if j > i:
            s = PyUnicode_FindChar(text, 1, i, j, 1)
            if s > i:
                PyDict_SetItem(props, PyUnicode_Substring(text, i, s), PyUnicode_Substring(text, s + 1, j))
        i = j + 1
    return props


# --- decode_received ---------------------------------------------------------------------------------------

cdef class _Layout:
    """How decode_received fills one ReceivedMessage class: straight into its slots (a dataclass with
    slots=True and the default __new__ and __setattr__), else through setattr, as the pure twin does."""
    cdef Py_ssize_t offsets[16]
    cdef bint direct


cdef _Layout _layout_of(object cls):
    cdef _Layout lay = _layouts.get(cls)
    cdef PyMemberDescrObject* d
    cdef Py_ssize_t i
    if lay is not None:
        return lay
    if not isinstance(cls, type):
        raise TypeError(f"decode_received needs a class, not {type(cls).__name__}")
    lay = _Layout()
    lay.direct = cls.__new__ is object.__new__ and cls.__setattr__ is object.__setattr__
    for i, name in enumerate(RECEIVED_FIELDS):
        descr = getattr(cls, name, None)
        if not lay.direct or type(descr) is not types.MemberDescriptorType:
            lay.direct = False
            break
        d = <PyMemberDescrObject*>descr
        if d.d_member.type != T_OBJECT_EX or d.d_member.flags & READONLY \
                or d.d_member.offset + <Py_ssize_t>sizeof(PyObject*) > (<PyTypeObject*>cls).tp_basicsize:
            lay.direct = False
            break
        lay.offsets[i] = d.d_member.offset
    if len(_layouts) > 64:
        _layouts.clear()
    _layouts[cls] = lay
    return lay


cdef inline void _put(object obj, Py_ssize_t offset, object value):
    """A new object's empty slot at ``offset`` set to ``value``."""
    Py_INCREF(value)
    (<PyObject**>((<char*><PyObject*>obj) + offset))[0] = <PyObject*>value


cdef object _host(const uint8_t* p):
    """message.unpack_host of the 8 stored bytes: (dotted IPv4, port)."""
    cdef char text[16]
    cdef int size
    key = rdu64(p)
    host = _hosts.get(key)
    if host is None:
        size = snprintf(text, 16, "%u.%u.%u.%u", p[0], p[1], p[2], p[3])
        host = (PyUnicode_DecodeASCII(text, size, NULL), rd32(p + 4))
        if len(_hosts) > MAX_HOSTS:
            _hosts.clear()
        _hosts[key] = host
    return host


cdef inline void _offset_id_text(const uint8_t* store_host, int64_t phys, char* text) noexcept nogil:
    """message.create_offset_msg_id's 32 characters into ``text``: the store host's 8 bytes and the
    commit-log offset, as upper hex."""
    cdef const char* digits = b"0123456789ABCDEF"
    cdef uint64_t v = <uint64_t>phys
    cdef int i
    for i in range(8):
        text[2 * i] = digits[store_host[i] >> 4]
        text[2 * i + 1] = digits[store_host[i] & 15]
    for i in range(15, -1, -1):
        text[16 + i] = digits[v & 15]
        v >>= 4


cdef object _offset_msg_id(const uint8_t* store_host, int64_t phys):
    """message.create_offset_msg_id: the store host's 8 bytes and the commit-log offset, as upper hex."""
    cdef char text[32]
    _offset_id_text(store_host, phys, text)
    return PyUnicode_DecodeASCII(text, 32, NULL)


def decode_received(object buf, object broker_name, object received_cls, object queue_cls):
    """model.decode_received_py: a pull answer's records straight to ``received_cls`` objects (made without
    __init__, each of RECEIVED_FIELDS set), one ``queue_cls(raw_topic, broker_name, queue_id)`` per queue
    and one host tuple per distinct host. Raises MessageFormatError (zlib.error for a compressed body that
    does not inflate)."""
    cdef Py_buffer view
    cdef const uint8_t* b
    cdef Py_ssize_t n, pos = 0
    cdef Rec r
    cdef _Last topics_seen = _Last()
    cdef list names = [], values = [], out = []
    cdef dict queues = {}, props
    cdef _Layout lay = _layout_of(received_cls)
    cdef Py_ssize_t* off = lay.offsets
    cdef int32_t last_qid = -1
    cdef uint64_t last_shost_key = 0, last_bhost_key = 0
    cdef PyObject* found
    cdef object last_topic = None, mq = None, shost = None, bhost = None, new = received_cls.__new__
    PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE)
    try:
        b = <const uint8_t*>view.buf
        n = view.len
        while pos < n:
            raw_topic = _record(b, n, pos, &r, topics_seen)
            try:
                props = _props_of(b + r.props, r.props_len, names, values)
            except UnicodeDecodeError as e:
                raise _format_error("properties are not UTF-8") from e
            body = _body(b, &r)
            topic = raw_topic
            if min(r.topic_len, n - r.topic) >= C_RETRY_LEN and \
                    memcmp(b + r.topic, <const char*>C_RETRY_PREFIX, C_RETRY_LEN) == 0:
                found = PyDict_GetItem(props, C_RETRY_TOPIC)
                if found != NULL:
                    topic = <object>found
            if mq is None or r.queue_id != last_qid or raw_topic is not last_topic:
                key = (raw_topic, r.queue_id)
                mq = queues.get(key)
                if mq is None:
                    mq = queues[key] = queue_cls(raw_topic, broker_name, r.queue_id)
                last_topic, last_qid = raw_topic, r.queue_id
            if shost is None or rdu64(b + pos + 64) != last_shost_key:
                shost = _host(b + pos + 64)
                last_shost_key = rdu64(b + pos + 64)
            if bhost is None or rdu64(b + pos + 48) != last_bhost_key:
                bhost = _host(b + pos + 48)
                last_bhost_key = rdu64(b + pos + 48)
            found = PyDict_GetItem(props, C_UNIQ)
            if found != NULL and <object>found:
                msg_id = <object>found
            else:
                msg_id = _offset_msg_id(b + pos + 64, r.phys)
            if lay.direct:
                msg = PyType_GenericAlloc(<PyTypeObject*>received_cls, 0)
                _put(msg, off[0], topic)
                _put(msg, off[1], body)
                _put(msg, off[2], msg_id)
                _put(msg, off[3], mq)
                _put(msg, off[4], r.queue_offset)
                _put(msg, off[5], r.phys)
                _put(msg, off[6], props)
                _put(msg, off[7], r.reconsume)
                _put(msg, off[8], r.born_ts)
                _put(msg, off[9], r.store_ts)
                _put(msg, off[10], bhost)
                _put(msg, off[11], shost)
                _put(msg, off[12], r.flag)
                _put(msg, off[13], r.sys_flag & ~C_COMPRESSED)
                _put(msg, off[14], r.total)
                _put(msg, off[15], raw_topic)
            else:
                msg = new(received_cls)
                msg.topic = topic
                msg.body = body
                msg.id = msg_id
                msg.queue = mq
                msg.queue_offset = r.queue_offset
                msg.commit_log_offset = r.phys
                msg.properties = props
                msg.reconsume_times = r.reconsume
                msg.born_timestamp = r.born_ts
                msg.store_timestamp = r.store_ts
                msg.born_host = bhost
                msg.store_host = shost
                msg.flag = r.flag
                msg.sys_flag = r.sys_flag & ~C_COMPRESSED
                msg.store_size = r.total
                msg.raw_topic = raw_topic
            out.append(msg)
            pos = r.end
    finally:
        PyBuffer_Release(&view)
    return out


# --- record_buffers: an answer's records straight into Arrow's column buffers ------------------------------

# which columns record_buffers builds, besides the fixed-width ones it always builds
cdef enum:
    W_VALUE = 1
    W_PROPERTIES = 2
    W_KEYS = 4
    W_TAGS = 8
    W_MSG_ID = 16
    W_DELIVER = 32
WANT_VALUE = W_VALUE
WANT_PROPERTIES = W_PROPERTIES
WANT_KEYS = W_KEYS
WANT_TAGS = W_TAGS
WANT_MSG_ID = W_MSG_ID
WANT_DELIVER = W_DELIVER
# the property names the columns read (the Spark source's, chronomq.spark.schema; a test checks they agree)
PROPERTY_KEYS = "KEYS"
PROPERTY_TAGS = "TAGS"
PROPERTY_DELIVER_MS = "__CHRONOMQ_DELIVER_MS"
PROPERTY_TIMER_DELIVER_MS = "TIMER_DELIVER_MS"

cdef bytes B_KEYS = PROPERTY_KEYS.encode()
cdef bytes B_TAGS = PROPERTY_TAGS.encode()
cdef bytes B_UNIQ = PROPERTY_UNIQ_KEY.encode()
cdef bytes B_DELIVER = PROPERTY_DELIVER_MS.encode()
cdef bytes B_TIMER = PROPERTY_TIMER_DELIVER_MS.encode()
cdef int64_t MAX_OFFSET32 = 0x7FFFFFFF


cdef class _Buf:
    """A growing byte buffer that ends as a bytearray (which pyarrow takes without a copy)."""
    cdef bytearray data
    cdef char* p
    cdef Py_ssize_t used, cap

    def __cinit__(self, Py_ssize_t cap):
        self.cap = cap if cap > 64 else 64
        self.data = PyByteArray_FromStringAndSize(NULL, self.cap)  # not zeroed: every byte used is written
        self.p = PyByteArray_AS_STRING(self.data)
        self.used = 0

    cdef inline char* room(self, Py_ssize_t k) except NULL:
        cdef Py_ssize_t cap
        if self.used + k > self.cap:
            cap = max(2 * self.cap, self.used + k)
            PyByteArray_Resize(self.data, cap)
            self.p = PyByteArray_AS_STRING(self.data)
            self.cap = cap
        return self.p + self.used

    cdef inline int put(self, const void* src, Py_ssize_t k) except -1:
        memcpy(self.room(k), src, k)
        self.used += k
        return 0

    cdef inline int put_i32(self, int32_t v) except -1:
        (<int32_t*>self.room(4))[0] = v
        self.used += 4
        return 0

    cdef inline int put_i64(self, int64_t v) except -1:
        (<int64_t*>self.room(8))[0] = v
        self.used += 8
        return 0

    cdef bytearray done(self):
        PyByteArray_Resize(self.data, self.used)
        return self.data


cdef class _Bits:
    """A validity bitmap (Arrow's order: bit i of byte i // 8, least significant first)."""
    cdef _Buf buf
    cdef Py_ssize_t n

    def __cinit__(self, Py_ssize_t rows):
        self.buf = _Buf(rows // 8 + 1)
        self.n = 0

    cdef inline int add(self, bint valid) except -1:
        cdef char* p
        if self.n % 8 == 0:
            p = self.buf.room(1)
            p[0] = 0
            self.buf.used += 1
        if valid:
            self.buf.p[self.n // 8] |= <char>(1 << (self.n % 8))
        self.n += 1
        return 0


cdef inline bint _is(const uint8_t* p, Py_ssize_t n, bytes name):
    return n == len(name) and memcmp(p, <const char*>name, n) == 0


cdef inline bint _ascii(const uint8_t* p, Py_ssize_t n) noexcept nogil:
    cdef uint8_t acc = 0
    cdef Py_ssize_t i
    for i in range(n):
        acc |= p[i]
    return acc < 0x80


cdef inline bint _int_ms(const uint8_t* p, Py_ssize_t n, int64_t* out) noexcept nogil:
    """A deliver time written plainly (an optional '-' and 1-15 digits) into ``out``; false for any other
    text, whose reading is left to Python's int()."""
    cdef Py_ssize_t i = 0
    cdef int64_t v = 0
    cdef bint neg = n > 0 and p[0] == 45
    if neg:
        i = 1
    if n - i < 1 or n - i > 15:
        return False
    while i < n:
        if p[i] < 48 or p[i] > 57:
            return False
        v = v * 10 + (p[i] - 48)
        i += 1
    out[0] = -v if neg else v
    return True


cdef inline int64_t _us(int64_t ms) noexcept nogil:
    """Epoch ms -> µs, wrapping as Arrow's unchecked multiply does."""
    return <int64_t>(<uint64_t>ms * 1000)


def record_buffers(list parts, int want):
    """Pull answers' records straight into the buffers of Arrow columns, for the Spark source
    (chronomq.spark.schema.buffers_to_batch): ``parts`` is a list of (answer body, first offset, end offset),
    the records with a queue offset in [first, end) are taken, in order. ``want``: the WANT_* bits of the
    columns to build besides the fixed-width ones (offset, timestamp, born_timestamp, reconsume_times), read
    from the properties as chronomq.spark.schema reads them (the map keeps every item with a name and a
    separator; tags, keys and ids take a name's last value; msg_id the UNIQ_KEY, or the offset id when it
    is missing or empty; deliver_time a plainly written deliver property). Returns a dict of bytearrays by
    column, or None where an answer needs the general path: a record it would refuse or a compressed body
    that does not inflate, anywhere in an answer (the general path raises the error), a topic or property
    text that is not ASCII, a deliver time not written plainly, a column's bytes past 2 GiB."""
    cdef Py_buffer view
    cdef const uint8_t* b
    cdef const uint8_t* pp
    cdef const uint8_t* q
    cdef Py_ssize_t n, pos, i, j, s, k, rows = 0, cap = 0, kl, w
    cdef int64_t lo, hi, dms
    cdef Rec r
    cdef _Last topics_seen = _Last()
    cdef Py_ssize_t tags_at, tags_end, keys_at, keys_end, uniq_at, uniq_end, dl_at, dl_end, tdl_at, tdl_end
    cdef Py_ssize_t nkeys, nitems, first_at, first_end
    cdef bint value = want & W_VALUE, props = want & W_PROPERTIES, keys = want & W_KEYS
    cdef bint tags = want & W_TAGS, msg_id = want & W_MSG_ID, deliver = want & W_DELIVER
    cdef bint scan = props or keys or tags or msg_id or deliver, found
    cdef char hexid[32]
    cdef Py_ssize_t rows_hint
    for part in parts:
        cap += len(part[0])
    rows_hint = cap // 256 + 16
    cdef _Buf voff = _Buf(4 * rows_hint), vdata = _Buf(cap if value else 0)
    cdef _Buf qoff = _Buf(8 * rows_hint), sts = _Buf(8 * rows_hint), bts = _Buf(8 * rows_hint)
    cdef _Buf rec = _Buf(4 * rows_hint)
    cdef _Buf moff = _Buf(4 * rows_hint), mkoff = _Buf(0), mkdata = _Buf(0), mvoff = _Buf(0), mvdata = _Buf(0)
    cdef _Buf toff = _Buf(4 * rows_hint), tdata = _Buf(0)
    cdef _Buf loff = _Buf(4 * rows_hint), kwoff = _Buf(0), kwdata = _Buf(0)
    cdef _Buf koff = _Buf(4 * rows_hint), kdata = _Buf(0)
    cdef _Buf ioff = _Buf(4 * rows_hint), idata = _Buf(32 * rows_hint)
    cdef _Buf dval = _Buf(8 * rows_hint)
    cdef _Bits tvalid = _Bits(rows_hint), kvalid = _Bits(rows_hint), dvalid = _Bits(rows_hint)
    voff.put_i32(0)
    moff.put_i32(0)
    mkoff.put_i32(0)
    mvoff.put_i32(0)
    toff.put_i32(0)
    loff.put_i32(0)
    kwoff.put_i32(0)
    koff.put_i32(0)
    ioff.put_i32(0)
    for part in parts:
        body, lo, hi = part
        PyObject_GetBuffer(body, &view, PyBUF_SIMPLE)
        try:
            b = <const uint8_t*>view.buf
            n = view.len
            pos = 0
            while pos < n:
                try:
                    _record(b, n, pos, &r, topics_seen)
                except Exception:
                    return None
                if not _ascii(b + r.topic, r.topic_len) or not _ascii(b + r.props, r.props_len):
                    return None
                inflated = None
                if r.sys_flag & C_COMPRESSED:  # every body must inflate, as record_columns checks
                    try:
                        inflated = _body(b, &r)
                    except Exception:
                        return None
                if r.queue_offset < lo or r.queue_offset >= hi:
                    pos = r.end
                    continue
                rows += 1
                if value:
                    if inflated is not None:
                        vdata.put(<const char*><bytes>inflated, len(<bytes>inflated))
                    else:
                        vdata.put(b + r.body, r.body_len)
                    if vdata.used > MAX_OFFSET32:
                        return None
                    voff.put_i32(<int32_t>vdata.used)
                qoff.put_i64(r.queue_offset)
                sts.put_i64(_us(r.store_ts))
                bts.put_i64(_us(r.born_ts))
                rec.put_i32(r.reconsume)
                if scan:
                    tags_at = keys_at = uniq_at = dl_at = tdl_at = -1
                    tags_end = keys_end = uniq_end = dl_end = tdl_end = 0
                    pp = b + r.props
                    k = r.props_len
                    i = 0
                    while i <= k:
                        q = <const uint8_t*>memchr(pp + i, 2, k - i) if i < k else NULL
                        j = (q - pp) if q != NULL else k
                        if j > i:
                            q = <const uint8_t*>memchr(pp + i, 1, j - i)
                            if q != NULL and q - pp > i:
                                s = q - pp
                                if props:
                                    mkdata.put(pp + i, s - i)
                                    mkoff.put_i32(<int32_t>mkdata.used)
                                    mvdata.put(pp + s + 1, j - s - 1)
                                    mvoff.put_i32(<int32_t>mvdata.used)
                                if _is(pp + i, s - i, B_TAGS):
                                    tags_at, tags_end = s + 1, j
                                elif _is(pp + i, s - i, B_KEYS):
                                    keys_at, keys_end = s + 1, j
                                elif _is(pp + i, s - i, B_UNIQ):
                                    uniq_at, uniq_end = s + 1, j
                                elif _is(pp + i, s - i, B_DELIVER):
                                    dl_at, dl_end = s + 1, j
                                elif _is(pp + i, s - i, B_TIMER):
                                    tdl_at, tdl_end = s + 1, j
                        i = j + 1
                    if props:
                        moff.put_i32(<int32_t>((mkoff.used - 4) // 4))
                    if tags:
                        tvalid.add(tags_at >= 0)
                        if tags_at >= 0:
                            tdata.put(pp + tags_at, tags_end - tags_at)
                        toff.put_i32(<int32_t>tdata.used)
                    if keys:
                        first_at = -1
                        first_end = 0
                        if keys_at >= 0:
                            i = keys_at
                            while i < keys_end:
                                q = <const uint8_t*>memchr(pp + i, 32, keys_end - i)
                                j = (q - pp) if q != NULL else keys_end
                                if j > i:
                                    kwdata.put(pp + i, j - i)
                                    kwoff.put_i32(<int32_t>kwdata.used)
                                    if first_at < 0:
                                        first_at, first_end = i, j
                                i = j + 1
                        loff.put_i32(<int32_t>((kwoff.used - 4) // 4))
                        kvalid.add(first_at >= 0)
                        if first_at >= 0:
                            kdata.put(pp + first_at, first_end - first_at)
                        koff.put_i32(<int32_t>kdata.used)
                    if msg_id:
                        if uniq_at >= 0 and uniq_end > uniq_at:
                            idata.put(pp + uniq_at, uniq_end - uniq_at)
                        else:  # the offset id, as decode_received gives it
                            _offset_id_text(b + pos + 64, r.phys, hexid)
                            idata.put(hexid, 32)
                        ioff.put_i32(<int32_t>idata.used)
                    if deliver:
                        found = False
                        dms = 0
                        if dl_at >= 0 and dl_end > dl_at:
                            if not _int_ms(pp + dl_at, dl_end - dl_at, &dms):
                                return None
                            found = True
                        elif tdl_at >= 0 and tdl_end > tdl_at:
                            if not _int_ms(pp + tdl_at, tdl_end - tdl_at, &dms):
                                return None
                            found = True
                        dvalid.add(found)
                        dval.put_i64(_us(dms) if found else 0)
                    if mkdata.used > MAX_OFFSET32 or mvdata.used > MAX_OFFSET32 or idata.used > MAX_OFFSET32 \
                            or kwdata.used > MAX_OFFSET32:
                        return None
                pos = r.end
        finally:
            PyBuffer_Release(&view)
    out = {"rows": rows, "offset": qoff.done(), "timestamp": sts.done(), "born_timestamp": bts.done(),
           "reconsume_times": rec.done()}
    if value:
        out["value"] = (voff.done(), vdata.done())
    if props:
        out["properties"] = (moff.done(), mkoff.done(), mkdata.done(), mvoff.done(), mvdata.done())
    if tags:
        out["tags"] = (toff.done(), tdata.done(), tvalid.buf.done())
    if keys:
        out["keys"] = (loff.done(), kwoff.done(), kwdata.done())
        out["key"] = (koff.done(), kdata.done(), kvalid.buf.done())
    if msg_id:
        out["msg_id"] = (ioff.done(), idata.done())
    if deliver:
        out["deliver_time"] = (dvalid.buf.done(), dval.done())
    return out
