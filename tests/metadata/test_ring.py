"""The event ring of the embedded index: bounded, found by seq with O(log n) reads (a poll at
the end of a full 100,000-event ring reads about log2(n) events, not n), same results as a
plain bounded deque."""

from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.metadata.index.ring import EventRing
from kvstore.metadata.records import IndexEvent


def event(seq: int) -> IndexEvent:
    return IndexEvent(seq, "stored", "t", bytes(16), "n", "host")


class CountingRing(EventRing):
    reads = 0

    def __getitem__(self, position):
        CountingRing.reads += 1
        return super().__getitem__(position)


def test_a_poll_at_the_end_of_a_full_ring_reads_log_n_events():
    """Regression: events_since walked the deque from its start, O(position) per poll."""
    ring = CountingRing(100_000)
    for seq in range(1, 250_001):
        ring.append(event(seq))
    CountingRing.reads = 0
    assert [e.seq for e in ring.since(249_999, 1024)] == [249_999, 250_000]
    assert CountingRing.reads <= 17 + 2 + 1  # bisect, the page, oldest check headroom
    assert ring.oldest_seq() == 150_001 and len(ring) == 100_000


@settings(max_examples=200, deadline=None)
@given(
    capacity=st.integers(0, 8),
    appended=st.integers(0, 30),
    from_seq=st.integers(0, 40),
    max_events=st.integers(0, 10),
)
def test_the_ring_answers_like_a_bounded_deque(capacity, appended, from_seq, max_events):
    ring, reference = EventRing(capacity), deque(maxlen=capacity)
    for seq in range(1, appended + 1):
        ring.append(event(seq))
        reference.append(event(seq))
    wanted = [e for e in reference if e.seq >= from_seq][:max_events]
    assert ring.since(from_seq, max_events) == wanted
    assert ring.oldest_seq() == (reference[0].seq if reference else None)
