"""fn over items on a few threads, the results handed back in the items' order, with a bound on the work
held at once (computing, or done and waiting for the consumer)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def ordered_map(
    fn: Callable[[T], R],
    items: Iterable[T],
    threads: int,
    cost: Callable[[T], int],
    budget: int,
    window: int | None = None,
) -> Iterator[tuple[T, R]]:
    """(item, fn(item)) for each item in order. Up to `threads` calls run at once, ahead of the consumer,
    while at most `window` items are held (submitted and not yet handed back; default threads + 1: every
    thread busy and one result ready) and their cost stays within budget; an item costing more than
    budget on its own runs when nothing else is held. A wider window lets the threads go on while the
    consumer is slow (a write waiting on the disk), even with one thread. threads <= 1 without a window:
    in the caller, one item at a time. If fn raises, the exception comes out at that item's turn and the
    items not yet started are dropped (those running finish first)."""
    if threads <= 1 and window is None:
        for item in items:
            yield item, fn(item)
        return
    threads = max(threads, 1)
    window = threads + 1 if window is None else max(window, 1)
    ex = ThreadPoolExecutor(threads, thread_name_prefix="moestream-map")
    held: deque[tuple[T, Future[R], int]] = deque()
    total = 0
    try:
        for item in items:
            c = cost(item)
            while held and (len(held) >= window or total + c > budget):
                first, fut, fc = held.popleft()
                total -= fc
                yield first, fut.result()
            held.append((item, ex.submit(fn, item), c))
            total += c
        while held:
            first, fut, fc = held.popleft()
            total -= fc
            yield first, fut.result()
    finally:
        ex.shutdown(wait=True, cancel_futures=True)
