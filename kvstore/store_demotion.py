"""Demotion ahead of need: the top tier's next victims are written into the tier below with
the ledger's lock released, until enough top-tier pages are free, so a save finds a free page
instead of waiting under the lock for a disk write (eviction under the lock stays the
fallback: StoreLedger). Runs in the node agent's demotion thread (kvstore/node/demotion.py).
"""

from __future__ import annotations

import threading

from kvstore.store_ledger import StoreLedger


class DemotionAhead:
    """Writes victims down ahead of need; the ledger picks, reserves, pins and commits."""

    def __init__(self, ledger: StoreLedger) -> None:
        self.ledger = ledger

    def demote_ahead(self, free_pages: int, stop: threading.Event | None = None) -> int:
        """Demote the top tier's next victims until `free_pages` of its pages are free (or
        `stop` is set). A victim pinned while it was written stays, in both tiers. Returns how
        many blocks were written down."""
        written = 0
        while not (stop and stop.is_set()) and (victim := self.ledger.next_demotion(free_pages)):
            done = False
            try:
                with self.ledger.slots[0].tier.open(victim.key) as page:
                    if page is not None:  # None: purged meanwhile (corrupt), nothing to write
                        lower = self.ledger.slots[1].tier
                        block = page[: victim.header.block_bytes]
                        lower.write_reserved(victim.key, victim.lower_page, block)
                        done = True
            finally:
                self.ledger.finish_demotion(victim.key, victim.header, done)
            written += done
        return written
