"""The distillation data pipeline as the data grows: time to the first training batch and peak
object-store use, for 1x, 4x and 16x a synthetic UltraChat-format set, on a local Ray.

    python -m benchmarks.bench_data --rows-per-file 2000 --scales 1 4 16 --batches 20

Each scale writes that many parquet files of ``--rows-per-file`` conversations in UltraChat's schema
(the same rows, renumbered), builds the job's pipeline (``swiftkv.distill.data.build_datasets``) with
the bundled tokenizer, and consumes it as two training workers do (``streaming_split(2, equal=True)``
with the order preserved, each worker reading micro-batches through its shuffle buffer) until each
worker has ``--batches`` micro-batches, then stops; twice per scale on a fresh local Ray: cold (the
first pass starts Ray Data's worker processes, as a job's first epoch does) and warm (as a later
epoch), each pass followed by a wait until the stopped pass's read-ahead has wound down (otherwise
the warm pass shares the CPUs with the cold one's leftover tasks). A thread polls the object store
meanwhile.
A pipeline that streams reaches its first batch in about the same time and holds about the same
object-store bytes at every scale; one that materialises the data (an all-to-all shuffle, a full
count) grows with it. Writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import threading
import time
from pathlib import Path

from swiftkv.bundled import ensure_bundled_model
from swiftkv.distill.config import DataConfig


def write_set(folder: Path, files: int, rows_per_file: int) -> str:
    """``files`` parquet files of UltraChat-format conversations in ``folder``; returns the glob."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        rows = []
        for i in range(rows_per_file):
            n = f * rows_per_file + i
            question = f"Question {n}: how would you explain topic {n % 97} to a friend who asks about it?"
            answer = " ".join(f"Point {k} about topic {n % 97} is worth a sentence of its own." for k in range(6))
            rows.append({"prompt": question, "prompt_id": str(n),
                         "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]})
        pq.write_table(pa.Table.from_pylist(rows), folder / f"train-{f:04d}.parquet")
    return str(folder / "*.parquet")


class StorePeak:
    """The peak object-store bytes in use while open (polled every 0.2 s through the GCS)."""

    def __enter__(self) -> StorePeak:
        import ray
        from ray._private.internal_api import get_memory_info_reply, get_state_from_address

        state = get_state_from_address(ray.get_runtime_context().gcs_address)
        self.peak, self._stop = 0, threading.Event()

        def poll() -> None:
            while not self._stop.is_set():
                self.peak = max(self.peak, get_memory_info_reply(state).store_stats.object_store_bytes_used)
                time.sleep(0.2)

        self._thread = threading.Thread(target=poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def consume(train, batches: int, micro_batch: int, buffer: int) -> tuple[float, float]:
    """(seconds to every worker's first batch, seconds to ``batches`` each) with two workers."""
    splits = train.streaming_split(2, equal=True)
    started = time.perf_counter()
    first: list[float] = []
    done: list[float] = []

    def worker(split) -> None:
        # Closed on leaving (not left to garbage collection): its prefetch thread stops and the split
        # coordinator is told, before the caller shuts Ray down (a thread still reading then makes
        # Ray's core worker end the process).
        with contextlib.closing(iter(split.iter_torch_batches(
                batch_size=micro_batch, drop_last=True, local_shuffle_buffer_size=buffer or None,
                local_shuffle_seed=0 if buffer else None))) as batches_iter:
            for i, _ in enumerate(batches_iter):
                if i == 0:
                    first.append(time.perf_counter() - started)
                if i + 1 == batches:
                    break
        done.append(time.perf_counter() - started)

    threads = [threading.Thread(target=worker, args=(split,)) for split in splits]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return max(first), max(done)


def wait_until_idle(timeout_s: float = 300.0) -> float:
    """Wait until no task holds a CPU (a stopped pass's read-ahead winds down, as the end of an
    epoch that consumed everything would have it); return the seconds waited."""
    import ray

    started = time.perf_counter()
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources().get("CPU", 0):
        if time.perf_counter() - started > timeout_s:
            raise TimeoutError(f"Ray tasks still hold CPUs {timeout_s:.0f} s after the pass stopped")
        time.sleep(0.5)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows-per-file", type=int, default=2000)
    parser.add_argument("--scales", type=int, nargs="+", default=[1, 4, 16], help="files in each set")
    parser.add_argument("--batches", type=int, default=20, help="micro-batches each worker reads")
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--num-cpus", type=int, default=4, help="logical CPUs of the local Ray")
    parser.add_argument("--out", type=Path, default=Path("artifacts/bench_data.json"))
    args = parser.parse_args()

    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    tokenizer = str(ensure_bundled_model())
    results = {"rows_per_file": args.rows_per_file, "batches_per_worker": args.batches,
               "max_seq_len": args.max_seq_len, "scales": {}}
    from swiftkv.distill.data import build_datasets

    with tempfile.TemporaryDirectory() as tmp:
        for scale in args.scales:
            uri = write_set(Path(tmp) / f"x{scale}", scale, args.rows_per_file)
            cfg = DataConfig(sources=[{"uri": uri, "format": "ultrachat"}], max_seq_len=args.max_seq_len,
                             heldout_fraction=0)
            # A fresh cluster per scale: its first pass pays the same process start-up at every scale
            # (a job's first epoch), the second runs on warm worker processes (a later epoch).
            ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False)
            ray.data.DataContext.get_current().execution_options.preserve_order = True  # as the job ingests
            ray.data.DataContext.get_current().enable_progress_bars = False
            row: dict[str, float] = {"conversations": scale * args.rows_per_file}
            try:
                for label in ("cold", "warm"):
                    with StorePeak() as store:
                        built = time.perf_counter()
                        train, _ = build_datasets(cfg, tokenizer)
                        first, done = consume(train, args.batches, 1, cfg.shuffle_buffer_rows)
                        build_s = time.perf_counter() - built - done
                    row[f"{label}_first_batch_s"] = round(first + build_s, 2)
                    row[f"{label}_batches_read_s"] = round(done + build_s, 2)
                    row[f"{label}_peak_object_store_mb"] = round(store.peak / 2**20, 1)
                    # Only --batches were read: the rest of the pass's read-ahead is still running.
                    row[f"{label}_wind_down_s"] = round(wait_until_idle(), 2)
            finally:
                ray.shutdown()
            results["scales"][f"{scale}x"] = row
            print(f"{scale}x ({row['conversations']} conversations): first batch after {row['cold_first_batch_s']} s "
                  f"cold / {row['warm_first_batch_s']} s warm, {args.batches} batches per worker after "
                  f"{row['cold_batches_read_s']} / {row['warm_batches_read_s']} s, peak object store "
                  f"{row['cold_peak_object_store_mb']} / {row['warm_peak_object_store_mb']} MB", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
