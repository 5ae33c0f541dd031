"""What the user sees on a terminal while work runs: a progress bar over the layers of a long prefill, and
a live status line (tokens/s) kept on the terminal's last row while text streams above it. Nothing here
changes what is computed."""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

PREFILL_BAR_TOKENS = 256  # prompts at least this long get a progress bar (on a terminal)


class _LayerProgress:
    """Trunk hooks that advance a bar after each layer and pass every call on to the hooks in place."""

    def __init__(self, inner: Any, bar: Any):
        self.inner, self.bar = inner, bar

    def enter(self, group: str) -> None:
        if self.inner is not None:
            self.inner.enter(group)

    def leave(self, group: str) -> None:
        if self.inner is not None:
            self.inner.leave(group)
        if group.startswith("layer."):
            self.bar.update(1)


@contextmanager
def prefill_progress(decoder: Any, tokens: int, show: bool | None, passes: int = 1) -> Iterator[None]:
    """A bar over the layers of `passes` forward passes while `tokens` are prefilled; show=None: only on
    a terminal for long prompts."""
    if show is None:
        show = tokens >= PREFILL_BAR_TOKENS and sys.stderr.isatty()
    layers = len(getattr(decoder, "blocks", None) or getattr(decoder, "layers", []))
    if not show or not layers:
        yield
        return
    from tqdm import tqdm

    inner = decoder.hooks
    with tqdm(
        total=layers * max(1, passes), desc=f"prefill {tokens} tokens", unit="layer", leave=False, file=sys.stderr
    ) as bar:
        decoder.hooks = _LayerProgress(inner, bar)
        try:
            yield
        finally:
            decoder.hooks = inner


class LiveStatus:
    """A status line on the terminal's bottom row; text written to `out` scrolls in the rows above it
    (an ANSI scroll region). Active only when out is a terminal that understands it."""

    def __init__(self, out: TextIO, enabled: bool | None = None):
        self.out = out
        if enabled is None:
            enabled = out.isatty() and os.environ.get("TERM", "dumb") not in ("dumb", "")
        self.rows = shutil.get_terminal_size((80, 24)).lines if enabled else 0
        self.enabled = enabled and self.rows >= 3
        self.t0 = time.perf_counter()
        self.last = 0.0
        if self.enabled:
            # make room for the status row, then confine scrolling to the rows above it
            out.write(f"\n\x1b[1A\x1b7\x1b[1;{self.rows - 1}r\x1b8")
            out.flush()

    def update(self, text: str, force: bool = False) -> None:
        now = time.perf_counter()
        if not self.enabled or (not force and now - self.last < 0.25):
            return
        self.last = now
        self.out.write(f"\x1b7\x1b[{self.rows};1H\x1b[2K\x1b[7m {text} \x1b[0m\x1b8")
        self.out.flush()

    def close(self) -> None:
        if self.enabled:
            self.out.write(f"\x1b7\x1b[{self.rows};1H\x1b[2K\x1b[r\x1b8")
            self.out.flush()
            self.enabled = False
