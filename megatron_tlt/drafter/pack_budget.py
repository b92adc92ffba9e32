"""How many rows a rank's next drafter micro-step may take: sized to the idle windows the rank has seen.

A micro-step still in flight when the rollout ends is dropped, so one that outlasts the window it starts in
trains nothing, however often it is retried. On a GPU a pack of ``drafter.pack_tokens`` takes milliseconds
and every window fits many; on 2 CPU cores a 2,048-row pack of a 135M policy (49k-token LM head) took 11 s,
longer than most of its rollout's idle windows (1-15 s): 1 micro-step finished in 12 steps and 10 were
dropped (bench/RESULTS.md, 2026-12-07). So each rank keeps what it measured:

  * its idle windows: from its share being done to the slowest rank being done (only those it waited in:
    the slowest rank's own wait is the barrier, not a window);
  * its seconds per row of training: over its last finished micro-steps, or the lower bound that a step
    dropped since gives (it ran that long without finishing its pack), whichever is longer.

and sizes the next rollout's packs so that a micro-step takes ``STEP_SHARE_OF_WINDOW`` x the duty cycle x the
median window: at a duty cycle of 0.25 that is an eighth of a typical window, so two micro-steps fit in one
and a window half the typical one still fits one (at 1.0, half a typical window: shorter ones drop theirs).
The rows are rounded down to a power of two (pack shapes repeat, and a small change in a measure does not
rebuild the packs), kept within [``MIN_PACK_TOKENS``, ``drafter.pack_tokens``]. Before anything is measured
the packs are full size. Packs below the longest sequence split it into chunks that cannot see each other
(``drafter/packing.py``), which costs acceptance (docs/tlt.md); on such a device the alternative is training
nothing.

Pure bookkeeping: no clock, no tensors; ``drafter/spot.py`` feeds it and applies it.
"""

from __future__ import annotations

import collections
import statistics

MIN_PACK_TOKENS = 128
"""The smallest pack it sizes to: below it a micro-step's fixed costs (the optimizer step, the LM head's
launch) dominate, and long sequences are cut into chunks that lose their context (``drafter/packing.py``)."""
STEP_SHARE_OF_WINDOW = 0.5
"""A micro-step's target length: this share of (the duty cycle x the median idle window)."""
WINDOWS_KEPT = 8
"""The idle windows the median is taken over: recent ones, as response lengths change with the policy."""
MIN_WINDOW_SECONDS = 0.05
"""Shorter waits are not counted as windows: no micro-step fits one, and the slowest rank's own wait (the barrier
completing) can take some milliseconds on a loaded machine."""
STEPS_KEPT = 8
"""The finished micro-steps the training speed is taken over (a pack at the end of the buffer may be short)."""


class PackBudget:
    """The rows of the next rollout's drafter packs on one rank, from its own idle windows and training speed."""

    def __init__(self, max_tokens: int, *, min_tokens: int = MIN_PACK_TOKENS):
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self.min_tokens = min(min_tokens, max_tokens)
        self._windows_s: collections.deque[float] = collections.deque(maxlen=WINDOWS_KEPT)
        self._finished: collections.deque[tuple[int, float]] = collections.deque(maxlen=STEPS_KEPT)
        self._dropped_bound: float | None = None
        """Seconds per row at least, from the micro-steps dropped since the last one finished."""

    def record_window(self, seconds: float) -> None:
        """One idle window of this rank (its share done to the slowest rank done); under ``MIN_WINDOW_SECONDS`` it
        was the slowest rank, or as good as, and is not counted."""
        if seconds >= MIN_WINDOW_SECONDS:
            self._windows_s.append(seconds)

    def record_finished(self, tokens: int, seconds: float) -> None:
        """A micro-step that finished: its rows and how long it took."""
        if tokens > 0 and seconds > 0:
            self._finished.append((tokens, seconds))
            self._dropped_bound = None

    def record_dropped(self, pack_tokens: int, seconds: float) -> None:
        """A micro-step of at most ``pack_tokens`` rows that ran ``seconds`` and was dropped unfinished: a row
        takes at least ``seconds / pack_tokens``. A step started late in its window gives a weak bound, which the
        finished steps' speed outweighs; steps that keep being dropped raise it until the packs fit again."""
        if pack_tokens > 0 and seconds > 0:
            self._dropped_bound = max(self._dropped_bound or 0.0, seconds / pack_tokens)

    @property
    def seconds_per_token(self) -> float | None:
        """Training time per row: measured on the last finished micro-steps, or the lower bound of those dropped
        since, whichever is longer (None before either)."""
        measured = [sum(s for _, s in self._finished) / sum(t for t, _ in self._finished)] if self._finished else []
        bound = [self._dropped_bound] if self._dropped_bound is not None else []
        return max(measured + bound, default=None)

    @property
    def median_window_seconds(self) -> float | None:
        return statistics.median(self._windows_s) if self._windows_s else None

    def tokens(self, duty_cycle: float) -> int:
        """Rows for the next rollout's packs (the module docstring's rule); ``max_tokens`` until a window and a
        training speed are known."""
        seconds_per_token = self.seconds_per_token
        if not self._windows_s or seconds_per_token is None:
            return self.max_tokens
        step_seconds = STEP_SHARE_OF_WINDOW * duty_cycle * self.median_window_seconds
        rows = int(step_seconds / seconds_per_token)
        if rows >= self.max_tokens:
            return self.max_tokens
        power_of_two = 1 << (rows.bit_length() - 1) if rows > 0 else 0
        return max(self.min_tokens, power_of_two)
