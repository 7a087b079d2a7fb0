"""Host tier scenarios: another process maps the arena by name and reads and writes in place;
segments left by a dead owner are cleaned up."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from kvstore.errors import NotFoundError
from kvstore.keys import BlockKey
from kvstore.tiers.host import ARENA_PREFIX, SHM_DIR, HostTier, attach_arena, remove_stale_arenas

PAGE = 4096

_READER_WRITER = textwrap.dedent(
    """
    import sys
    from kvstore.tiers.host import attach_arena
    arena = attach_arena(sys.argv[1], 4, 4096)
    row = int(sys.argv[2])
    print(int(arena.pages[row, :16].sum()))      # read what the owner wrote, in place
    arena.pages[row + 1, :16].fill_(7)           # write in place for the owner to see
    arena.close()
    """
)


def test_another_process_reads_and_writes_pages_in_place():
    with HostTier(4 * PAGE, PAGE) as tier:
        key = BlockKey(bytes(16))
        page = tier.reserve(key)
        page[:16].fill_(3)
        tier.commit(key, 16)
        row = tier.page_index(key)
        out = subprocess.run(
            [sys.executable, "-c", _READER_WRITER, tier.arena_name, str(row)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        assert out.stdout.strip() == str(3 * 16)
        assert torch.equal(tier.pages[row + 1, :16], torch.full((16,), 7, dtype=torch.uint8))
        assert (SHM_DIR / tier.arena_name).exists(), "an attached process never unlinks"
    assert not (SHM_DIR / tier.arena_name).exists(), "the owner unlinks on close"


def test_attaching_a_missing_arena_is_a_clear_error():
    with pytest.raises(NotFoundError, match="no shared arena"):
        attach_arena("kvstore-arena-does-not-exist", 1, PAGE)


def test_arenas_of_dead_owners_are_removed_and_live_ones_kept():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    stale = SHM_DIR / f"{ARENA_PREFIX}{dead}-stale"
    stale.write_bytes(b"x")
    live = SHM_DIR / f"{ARENA_PREFIX}{os.getpid()}-live"
    live.write_bytes(b"x")
    try:
        removed = remove_stale_arenas()
        assert stale.name in removed and not stale.exists()
        assert live.exists()
    finally:
        live.unlink(missing_ok=True)
        stale.unlink(missing_ok=True)
