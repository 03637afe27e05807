"""Progress: a tqdm bar (documents/s, tokens/s, ETA) when stderr is a terminal, else one line
every --log-interval seconds; and the summary line at the end."""

from __future__ import annotations

import sys
import time
from collections import Counter


def _rate(count: float, seconds: float) -> str:
    value = count / max(seconds, 1e-9)
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.2f}{unit}"
    return f"{value:.0f}"


class Progress:
    def __init__(self, total_bytes: int, log_interval: float, stream=None,
                 piece_cache: bool = False):
        self.stream = stream or sys.stderr
        self.piece_cache = piece_cache  # whether the workers have piece_cache's encoder
        self.fast = Counter()
        self.total_bytes = max(1, total_bytes)
        self.log_interval = log_interval
        self.start = self.last_log = time.monotonic()
        self.documents = self.tokens = self.done_bytes = 0
        self.skipped = Counter()
        self.bar = None
        if self.stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, file=self.stream,
                            desc="prepare_data", dynamic_ncols=True)

    def update(self, documents: int, tokens: int, skipped: Counter, input_bytes: int,
               fast: Counter | None = None) -> None:
        self.fast.update(fast or {})
        self.documents += documents
        self.tokens += tokens
        self.skipped.update(skipped)
        self.done_bytes += input_bytes
        elapsed = time.monotonic() - self.start
        if self.bar is not None:
            self.bar.set_postfix_str(f"{_rate(self.documents, elapsed)} docs/s, "
                                     f"{_rate(self.tokens, elapsed)} tokens/s", refresh=False)
            self.bar.update(input_bytes)
        elif time.monotonic() - self.last_log >= self.log_interval:
            self.last_log = time.monotonic()
            fraction = min(1.0, self.done_bytes / self.total_bytes)
            eta = elapsed * (1 - fraction) / fraction if fraction else float("nan")
            print(f"prepare_data: {fraction:.1%} of input, {self.documents} documents, "
                  f"{self.tokens} tokens, {_rate(self.documents, elapsed)} docs/s, "
                  f"{_rate(self.tokens, elapsed)} tokens/s, ETA {eta:.0f} s",
                  file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def summary(self) -> str:
        reasons = ", ".join(f"{reason}: {n}" for reason, n in sorted(self.skipped.items()))
        skipped = sum(self.skipped.values())
        path = (f"; {self.fast['documents']} documents by the piece cache, "
                f"{self.fast['mismatches']} mismatches" if self.piece_cache else
                "; the tokenizer's own encoding (not one the piece cache reproduces)")
        return (f"{self.documents} documents, {self.tokens} tokens, "
                f"{skipped} skipped{f' ({reasons})' if reasons else ''}, "
                f"{time.monotonic() - self.start:.1f} seconds{path}")
