"""Host tier scenarios: another process maps the arena and reads and writes in place; no other
user can open it; segments left by a dead owner are cleaned up, whatever pid reuse did."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from kvstore.errors import NotFoundError
from kvstore.keys import BlockKey
from kvstore.tiers.host import (
    ARENA_PREFIX,
    SHM_DIR,
    HostTier,
    attach_arena,
    map_fd,
    remove_stale_arenas,
)

PAGE = 4096

_READER_WRITER = textwrap.dedent(
    """
    import sys
    from kvstore.tiers.host import attach_arena
    arena = attach_arena(sys.argv[1], 4 * 4096)
    pages = arena.flat.view(4, 4096)
    row = int(sys.argv[2])
    print(int(pages[row, :16].sum()))      # read what the owner wrote, in place
    pages[row + 1, :16].fill_(7)           # write in place for the owner to see
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
            capture_output=True,
            text=True,
            check=True,
        )
        assert out.stdout.strip() == str(3 * 16)
        assert torch.equal(tier.pages[row + 1, :16], torch.full((16,), 7, dtype=torch.uint8))
        assert (SHM_DIR / tier.arena_name).exists(), "an attached process never unlinks"
    assert not (SHM_DIR / tier.arena_name).exists(), "the owner unlinks on close"


def test_attaching_a_missing_arena_is_a_clear_error():
    with pytest.raises(NotFoundError, match="no shared arena"):
        attach_arena("kvstore-arena-does-not-exist", PAGE)


def test_the_arena_file_is_the_agents_alone():
    with HostTier(4 * PAGE, PAGE) as tier:
        mode = (SHM_DIR / tier.arena_name).stat().st_mode & 0o777
        assert mode == 0o600, "other users (and groups) get a descriptor from the agent or nothing"


def test_arenas_of_dead_owners_are_removed_and_live_ones_kept():
    """Regression: ownership went by the pid in the name, so after pid reuse a dead agent's
    arena (a whole host tier in /dev/shm) was taken for a live one and leaked."""
    reused_pid = os.getpid()  # the name says "alive"; no process holds its lock
    stale = SHM_DIR / f"{ARENA_PREFIX}{reused_pid}-stale"
    stale.write_bytes(b"x")
    with HostTier(4 * PAGE, PAGE) as live:
        try:
            removed = remove_stale_arenas()
            assert stale.name in removed and not stale.exists()
            assert (SHM_DIR / live.arena_name).exists()
        finally:
            stale.unlink(missing_ok=True)


def test_workers_get_the_arena_even_after_its_name_was_unlinked():
    """Another process (a foreign cleanup) unlinking the name does not cut off new workers."""
    with HostTier(4 * PAGE, PAGE) as tier:
        tier.pages[1, :8].fill_(9)
        (SHM_DIR / tier.arena_name).unlink()
        fd = tier.arena.open_fd()
        try:
            mapped = map_fd(fd, 4 * PAGE)
        finally:
            os.close(fd)
        assert int(mapped.flat.view(4, PAGE)[1, :8].sum()) == 72
        mapped.close()


def test_an_arena_larger_than_its_filesystem_is_refused_at_start():
    """The arena file is sparse: an agent whose /dev/shm could not hold it (Docker's is 64 MiB)
    started and died of SIGBUS at the first save past what the filesystem held."""
    from kvstore.errors import ConfigError

    stats = os.statvfs(SHM_DIR)
    free = stats.f_bavail * stats.f_frsize
    with pytest.raises(ConfigError, match=r"host arena needs \d+ bytes but .* free"):
        HostTier(free + (64 << 20), PAGE)
