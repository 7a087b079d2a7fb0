"""The sockets a process listens on, read from the kernel's tables (for tests of what binds where
and what a failure leaves behind)."""

from __future__ import annotations

import contextlib
import os


def listening_sockets(pid: int | str = "self") -> set[tuple[str, int]]:
    """(local address, port) of every socket process `pid` listens on, from /proc/net/tcp{,6}
    (addresses as the kernel prints them: 0100007F is 127.0.0.1, 00000000 any IPv4)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                address, _, hex_port = fields[1].rpartition(":")
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    found.add((address, int(hex_port, 16)))
    return found
