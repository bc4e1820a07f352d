"""A batch put's answer text (store.put.batch_msg_ids) is each record's offset message id, comma-joined, as
create_offset_msg_id makes it, for any store host, first offset and record sizes."""

from __future__ import annotations

from itertools import accumulate

from hypothesis import given, settings
from hypothesis import strategies as st

from chronomq.message import create_offset_msg_id, pack_host
from chronomq.store.put import batch_msg_ids

hosts = st.tuples(st.ip_addresses(v=4).map(str), st.integers(0, 0x7FFFFFFF))


@settings(max_examples=300, deadline=None)
@given(hosts, st.integers(0, (1 << 63) - (1 << 40)),
       st.lists(st.integers(1, 1 << 30), min_size=1, max_size=80))
def test_the_answer_text_is_every_record_offset_message_id(host: tuple[str, int], first: int,
                                                           sizes: list[int]) -> None:
    prefix = pack_host(host).hex().upper()
    offsets = accumulate(sizes[:-1], initial=first)
    assert batch_msg_ids(prefix, first, sizes) == ",".join(create_offset_msg_id(host, o) for o in offsets)
