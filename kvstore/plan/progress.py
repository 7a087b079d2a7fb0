"""The progress bar of long replays and validations: one line on stderr, rewritten in place at
most every `interval_s`, silent unless stderr is a terminal or the bar is forced. Runs in the
`kvstore plan` process; it never writes to stdout, so `--json` keeps stdout to one object.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TextIO, TypeVar

from kvstore.errors import ConfigError

MODES = ("auto", "always", "never")  # auto: only when stderr is a terminal
INTERVAL_S = 0.25  # at most four redraws a second: a redraw costs more than a replayed request

Item = TypeVar("Item")


class Progress:
    """`done` of `total` units under a label. `advance` only counts and reads the clock; the
    line is redrawn when `interval_s` has passed since the last redraw, and once more by
    `close`. With no stream it is silent. Not thread-safe: one owner advances it."""

    def __init__(
        self,
        stream: TextIO | None,
        total: int,
        unit: str,
        interval_s: float = INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream = stream
        self.total = total
        self.unit = unit
        self.interval_s = interval_s
        self.clock = clock
        self.label = ""
        self.done = 0
        self.started_s = clock()
        self._drawn_s = -math.inf
        self._width = 0

    def start(self, total: int, label: str) -> None:
        """Count from zero towards `total` from now (rate and eta leave out setup time)."""
        self.total, self.label, self.done = total, label, 0
        self.started_s = self.clock()

    def describe(self, label: str) -> None:
        """Name the current stage; shown from the next redraw on."""
        self.label = label

    def advance(self, count: int = 1) -> None:
        self.done += count
        if self.stream is not None and self.clock() - self._drawn_s >= self.interval_s:
            self._draw()

    def track(self, items: Iterable[Item]) -> Iterator[Item]:
        """Yield `items`, advancing by one after each."""
        for item in items:
            yield item
            self.advance()

    def close(self) -> None:
        """Draw the final count and end the line; later calls do nothing."""
        if self.stream is not None:
            self._draw()
            self.stream.write("\n")
            self.stream.flush()
            self.stream = None

    def line(self) -> str:
        elapsed_s = max(self.clock() - self.started_s, 1e-9)
        rate = self.done / elapsed_s
        text = f"{self.label}: " if self.label else ""
        text += f"{self.done:,}/{self.total:,} {self.unit}"
        if self.total > 0:
            text += f" {min(self.done / self.total, 1.0):4.0%}"
        text += f"  {rate:,.0f}" if rate >= 100 else f"  {rate:.3g}"  # 12,345 or 0.25
        text += f" {self.unit}/s"
        if self.total > self.done and rate > 0:
            text += f"  eta {_clock_text((self.total - self.done) / rate)}"
        return text + f"  elapsed {_clock_text(elapsed_s)}"

    def _draw(self) -> None:
        text = self.line()
        self.stream.write("\r" + text.ljust(self._width))
        self.stream.flush()
        self._width = len(text)
        self._drawn_s = self.clock()


def progress_bar(mode: str, total: int, unit: str, stream: TextIO | None = None) -> Progress:
    """A bar on `stream` (default: stderr) when `mode` is `always`, or `auto` and the stream is
    a terminal; a silent one otherwise."""
    if mode not in MODES:
        raise ConfigError(f"--progress {mode!r} unknown; use one of {MODES}")
    stream = sys.stderr if stream is None else stream
    shown = mode == "always" or (mode == "auto" and _is_terminal(stream))
    return Progress(stream if shown else None, total, unit)


def silent() -> Progress:
    return Progress(None, 0, "")


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or file-less stream
        return False


def _clock_text(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
