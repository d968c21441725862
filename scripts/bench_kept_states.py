#!/usr/bin/env python
"""What keeping a checked lease's end state costs the coordinator (coordinator/chained.py ``StateStore``), at a
preset's size: one state in a reveal part's layout (AdamW's two moments, with error feedback the residual: ≈ 12 bytes
a weight, 1.8 GB at 150m).

    python scripts/bench_kept_states.py --preset 150m --json runs/bench/kept-states-150m.json
    python scripts/bench_kept_states.py --smoke          # tiny, seconds

Side by side, in one run: a numpy memcpy of the state (what ``keep_states_on: memory`` costs), the disk store's
``put`` (a write into the page cache, then mapped), the same write with an fsync (what it would cost to make it
durable — the store does not), the join of a kept start into the reveal the re-run takes (``join_parts``: from the
page cache, and cold — the file's pages dropped with ``posix_fadvise``, as after the kernel reclaimed them). The
join of a state this large runs in a worker thread, not on the coordinator's event loop (coordinator/verify.py
``_offer_with_start``); the put runs in the verifier's worker thread.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncloco.coordinator.chained import StateStore  # noqa: E402
from asyncloco.models.presets import count_parameters  # noqa: E402
from asyncloco.train.commitments import join_parts  # noqa: E402


def timed(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """The best of ``repeats`` wall times of ``fn`` (and its last result)."""
    best, result = float("inf"), None
    for _ in range(repeats):
        started = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - started)
    return best, result


def measure(preset: str, directory: Path, repeats: int, vocab_size: int | None = None) -> dict[str, Any]:
    numel = count_parameters(preset, vocab_size)
    size = 12 * numel + 8  # exp_avg, exp_avg_sq and the residual in fp32, and a length field (train/commitments.py)
    state = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    view = state.data.cast("B")
    copy = np.empty_like(state)
    memcpy_s, _ = timed(lambda: np.copyto(copy, state), repeats)
    store = StateStore(directory)
    put_s, kept = timed(lambda: store.put("Lbench", view), repeats)
    assert kept is not None and len(kept) == size

    def durable() -> None:
        with open(directory / "fsync.bin", "wb") as out:
            out.write(view)
            out.flush()
            os.fsync(out.fileno())

    fsync_s, _ = timed(durable, repeats)
    (directory / "fsync.bin").unlink()
    join_s, joined = timed(lambda: join_parts(kept, b""), repeats)
    assert bytes(joined[8:40]) == bytes(view[:32])

    del kept, joined  # no mapping left: the kernel may drop the file's pages

    def cold_join() -> memoryview:
        path = directory / "Lbench.state"
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages are not dropped: written back first
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return join_parts(np.memmap(path, dtype=np.uint8, mode="r").data.cast("B"), b"")

    cold_s, _ = timed(cold_join, repeats)
    store.clear()
    gb = size / 1e9
    return {
        "preset": preset, "numel": numel, "state_bytes": size, "repeats": repeats,
        "memcpy_s": memcpy_s, "put_s": put_s, "fsync_write_s": fsync_s, "join_cached_s": join_s, "join_cold_s": cold_s,
        "put_vs_memcpy": put_s / memcpy_s, "fsync_write_vs_put": fsync_s / put_s,
        "join_cached_vs_memcpy": join_s / memcpy_s, "join_cold_vs_memcpy": cold_s / memcpy_s,
        "put_gb_per_s": gb / put_s, "join_cold_gb_per_s": gb / cold_s,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="150m", help="model preset whose state size is measured (tiny/20m/60m/150m)")
    parser.add_argument("--dir", type=Path, help="where the store writes (default: a temporary directory)")
    parser.add_argument("--vocab-size", type=int, default=None, help="default: the preset's (tiny has none: 4096)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--smoke", action="store_true", help="the tiny preset, one repeat (tests)")
    args = parser.parse_args()
    if args.smoke:
        args.preset, args.repeats = "tiny", 1
    if args.preset == "tiny" and args.vocab_size is None:
        args.vocab_size = 4096  # the project's embedded tokenizer's
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        r = measure(args.preset, Path(scratch) / "kept-states", args.repeats, args.vocab_size)
    print(f"preset {r['preset']}: {r['numel']:,} parameters, one kept state {r['state_bytes'] / 1e9:.3f} GB "
          f"(best of {r['repeats']})")
    print(f"  memcpy (keep_states_on: memory)      {r['memcpy_s']:8.3f} s   1.00 ×")
    print(f"  put (disk store: write, map)         {r['put_s']:8.3f} s   {r['put_vs_memcpy']:.2f} × memcpy "
          f"({r['put_gb_per_s']:.2f} GB/s)")
    print(f"  the same write with fsync            {r['fsync_write_s']:8.3f} s   {r['fsync_write_vs_put']:.2f} × put")
    print(f"  join into a reveal, page cache       {r['join_cached_s']:8.3f} s   {r['join_cached_vs_memcpy']:.2f} × memcpy")
    print(f"  join into a reveal, cold             {r['join_cold_s']:8.3f} s   {r['join_cold_vs_memcpy']:.2f} × memcpy "
          f"({r['join_cold_gb_per_s']:.2f} GB/s)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
