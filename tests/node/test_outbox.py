"""A node's outbox: a block's events in their order (the service's event stream, and the
routers that read it, see a block stored and evicted between two flushes), batched by kind and
tenant, and at its bound a defined loss that never leaves the service naming a holder for a
block the node dropped."""

from kvstore.events import BlockEvent, EventKind
from kvstore.node.outbox import Outbox

STORED, REMOVED = EventKind.STORED, EventKind.REMOVED


def event(kind, n, tenant="t", tier="host"):
    return BlockEvent(0, kind, n.to_bytes(16, "big"), tier, 4096, tenant)


def drain(outbox, max_entries=100):
    batches = []
    while (batch := outbox.take(max_entries)) is not None:
        batches.append((batch.kind, batch.tenant, [int.from_bytes(e.key) for e in batch.events]))
    return batches


def test_a_block_stored_then_evicted_before_a_flush_sends_both_in_order():
    outbox = Outbox(max_pending=100)
    outbox.add([event(STORED, 1), event(STORED, 2), event(REMOVED, 1)])
    assert drain(outbox) == [(STORED, "t", [1, 2]), (REMOVED, "t", [1])]


def test_a_block_evicted_then_stored_again_sends_both_in_order():
    outbox = Outbox(max_pending=100)
    outbox.add([event(REMOVED, 1), event(STORED, 1), event(STORED, 1)])  # a repeat: one
    assert drain(outbox) == [(REMOVED, "t", [1]), (STORED, "t", [1])]


def test_batches_hold_one_tenant_and_at_most_max_entries_in_order():
    outbox = Outbox(max_pending=100)
    outbox.add([event(STORED, n, tenant="a" if n % 2 else "b") for n in range(10)])
    assert drain(outbox, max_entries=3) == [
        (STORED, "b", [0, 2, 4]),  # the oldest event's tenant first
        (STORED, "a", [1, 3, 5]),
        (STORED, "b", [6, 8]),
        (STORED, "a", [7, 9]),
    ]


def test_a_batch_that_failed_goes_back_ahead_of_newer_events_but_never_over_them():
    outbox = Outbox(max_pending=100)
    outbox.add([event(STORED, 1), event(STORED, 2)])
    batch = outbox.take(10)
    outbox.add([event(REMOVED, 2), event(STORED, 3)])  # 2 was evicted while the call failed
    outbox.restore(batch)
    assert drain(outbox) == [(STORED, "t", [1, 2, 3]), (REMOVED, "t", [2])]


def test_at_the_bound_a_new_store_is_dropped_and_counted():
    outbox = Outbox(max_pending=2)
    outbox.add([event(STORED, 1), event(STORED, 2), event(STORED, 3)])
    assert outbox.dropped == 1 and not outbox.overflowed
    assert drain(outbox) == [(STORED, "t", [1, 2])]


def test_at_the_bound_an_event_that_undoes_a_pending_one_cancels_it():
    """Stored and evicted between two flushes, at the bound: the service hears of neither."""
    outbox = Outbox(max_pending=2)
    outbox.add([event(STORED, 1), event(STORED, 2), event(REMOVED, 2), event(STORED, 1)])
    assert outbox.dropped == 0 and len(outbox) == 1
    assert drain(outbox) == [(STORED, "t", [1])]


def test_at_the_bound_an_eviction_pushes_out_the_oldest_pending_store():
    """The dropped store is never published (a miss elsewhere); the eviction is kept, so
    the service never goes on naming this node for a block it no longer holds."""
    outbox = Outbox(max_pending=2)
    outbox.add([event(STORED, 1), event(STORED, 2), event(REMOVED, 9)])
    assert outbox.dropped == 1 and not outbox.overflowed
    assert drain(outbox) == [(STORED, "t", [2]), (REMOVED, "t", [9])]


def test_at_the_bound_with_only_evictions_pending_the_outbox_asks_for_a_resync():
    outbox = Outbox(max_pending=2)
    outbox.add([event(REMOVED, 1), event(REMOVED, 2), event(REMOVED, 3)])
    assert outbox.overflowed
    outbox.clear()  # the link re-registers and publishes its inventory instead
    assert not outbox.overflowed and len(outbox) == 0
