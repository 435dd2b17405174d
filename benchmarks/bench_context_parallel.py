#!/usr/bin/env python
"""Context parallelism on one machine: P processes × 1 thread against one process × P threads.

Run as `python benchmarks/bench_context_parallel.py [--length 16384] [--heads 4] [--d 64]
[--world 2] [--out PREFIX]` from a checkout with an in-place build (or anywhere with an installed
attention_ext). A long causal sequence (top-left, n == m) runs forward and forward+backward:
  * single: attention() in this process on all P threads;
  * cp zigzag / cp contiguous: context_parallel_attention over P spawned processes on loopback gloo,
    one thread each, every rank holding its shard of q, k and v.
Candidates are interleaved rep by rep (single, then each layout; the idle side waits on a queue,
using no CPU). The CP time is the slowest rank's (they start together after a barrier). Parallel
efficiency = t_single / t_CP: 1.0 means the ring costs nothing over the threaded kernel. Also per
rank: bytes sent, and the ring's per-step compute time against its wall time (the wait after
computing is what the transfer did not hide). GFLOP/s count the causal half (backward 2.5×
forward); % of peak is against the FMA peak of P threads measured in the same run.
"""
from __future__ import annotations

import argparse
import datetime
import os
import queue
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402  (machine measurements and naming)
from bench_window import peak_text, publish, settle_peak  # noqa: E402

import attention_ext  # noqa: E402
import attention_ext.distributed as cp  # noqa: E402

LAYOUTS = ("zigzag", "contiguous")


def make_inputs(length, heads, d, dtype):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, heads, length, d, generator=g).to(dtype) for _ in range(4)]  # q, k, v, grad_out


def run_mode(fn, tensors, grad, mode):
    if mode == "fwd":
        with torch.no_grad():
            fn(*tensors)
        return
    leaves = [t.detach().requires_grad_() for t in tensors]
    fn(*leaves).backward(grad)


def _worker(rank, world, rendezvous, shape, tasks, results):
    torch.set_num_threads(1)
    # through a file: a TCP port found free could be taken by another process before rank 0 binds it
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    length, heads, d, dtype = shape
    full = make_inputs(length, heads, d, dtype)
    shards = {layout: [cp.shard(t, layout) for t in full] for layout in LAYOUTS}
    while True:
        item = tasks.get()
        if item is None:
            break
        layout, mode = item
        q, k, v, go = shards[layout]
        fn = lambda *t: cp.context_parallel_attention(*t, layout=layout, causal="top_left")  # noqa: E731
        dist.barrier()
        with cp.record_ring_steps() as steps:
            start = time.perf_counter()
            run_mode(fn, (q, k, v), go, mode)
            wall = time.perf_counter() - start
        results.put((rank, wall, steps))
    dist.destroy_process_group()


class Ranks:
    def __init__(self, world, shape):
        ctx = mp.get_context("spawn")
        self.folder = tempfile.mkdtemp(prefix="attention_ext_ranks_")
        rendezvous = os.path.join(self.folder, "rendezvous")
        self.world, self.results = world, ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.procs = [ctx.Process(target=_worker, args=(r, world, rendezvous, shape, self.tasks[r], self.results),
                                  daemon=True) for r in range(world)]
        for p in self.procs:
            p.start()

    def run(self, layout, mode):
        for t in self.tasks:
            t.put((layout, mode))
        got = {}
        while len(got) < self.world:
            try:
                rank, wall, steps = self.results.get(timeout=5)
                got[rank] = (wall, steps)
            except queue.Empty:
                if not all(p.is_alive() for p in self.procs):
                    raise RuntimeError("a rank exited") from None
        return [got[r] for r in range(self.world)]

    def close(self):
        for t in self.tasks:
            t.put(None)
        for p in self.procs:
            p.join(timeout=30)
        shutil.rmtree(self.folder, ignore_errors=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--world", type=int, default=2, help="processes (each 1 thread); single uses this many threads")
    ap.add_argument("--dtype", choices=list(bench.DTYPES), default="float32")
    ap.add_argument("--modes", default="fwd,fwdbwd")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None, help="write PREFIX.md and PREFIX.json")
    a = ap.parse_args(argv)
    dtype = bench.DTYPES[a.dtype]
    torch.set_num_threads(a.world)
    peak = bench.measure_fma_peak()
    meta = {"cpu": bench.cpu_name(), "torch": torch.__version__, "world": a.world, "variant": attention_ext.cpu_variant(),
            "dtype": a.dtype, "length": a.length, "heads": a.heads, "d": a.d, "reps": a.reps,
            "command": "python benchmarks/bench_context_parallel.py " + " ".join(argv if argv is not None
                                                                                 else sys.argv[1:])}
    print(f"{meta['cpu']}: FMA peak {peak['gflops']:.0f} GFLOP/s on {a.world} threads", flush=True)
    q, k, v, go = make_inputs(a.length, a.heads, a.d, dtype)
    single = lambda *t: attention_ext.attention(*t, causal="top_left")  # noqa: E731
    ranks = Ranks(a.world, (a.length, a.heads, a.d, dtype))
    rows = []
    try:
        for mode in a.modes.split(","):
            times = {"single": [], **{f"cp {layout}": [] for layout in LAYOUTS}}
            detail = {}
            for rep in range(a.reps + 1):  # the first round warms up and is dropped
                start = time.perf_counter()
                run_mode(single, (q, k, v), go, mode)
                elapsed = time.perf_counter() - start
                per_layout = {layout: ranks.run(layout, mode) for layout in LAYOUTS}
                if rep == 0:
                    continue
                times["single"].append(elapsed)
                for layout, per_rank in per_layout.items():
                    times[f"cp {layout}"].append(max(wall for wall, _ in per_rank))
                    detail[layout] = per_rank  # the last rep's step logs
            flops = bench.mode_flops((1, a.heads, a.length, a.length, a.d, True, None), mode)
            t_single = statistics.median(times["single"])
            for name, samples in times.items():
                t = statistics.median(samples)
                row = {"mode": mode, "candidate": name, "ms": t * 1e3, "samples_ms": [s * 1e3 for s in samples],
                       "efficiency": t_single / t, "gflops": flops / t / 1e9}
                if name != "single":
                    per_rank = detail[name.split()[1]]
                    row["ranks"] = [{"wall_ms": wall * 1e3,
                                     "bytes_sent": sum(s["bytes_sent"] for s in steps),
                                     "steps": [{k: s[k] for k in ("pass", "step", "compute_s", "wait_s", "bytes_sent")}
                                               for s in steps]} for wall, steps in per_rank]
                rows.append(row)
                print(f"{mode} {name}: {t * 1e3:.1f} ms, efficiency {t_single / t:.2f}", flush=True)
    finally:
        ranks.close()
    settle_peak(meta, peak["gflops"])
    publish(a.out, render(meta, rows), {"meta": meta, "rows": rows})


def render(meta, rows):
    peak = meta["fma_peak_gflops"]
    lines = [f"# Context parallelism, {meta['dtype']}, {meta['cpu']}", "",
             f"torch {meta['torch']}, kernel variant {meta['variant']}; measured FMA peak of {meta['world']} threads "
             f"{peak_text(meta)}. One causal (top-left) sequence of "
             f"{meta['length']} tokens, {meta['heads']} heads, head dim {meta['d']}. single: attention() in one "
             f"process on {meta['world']} threads; cp: context_parallel_attention over {meta['world']} processes × 1 "
             f"thread on loopback gloo. Median of {meta['reps']} interleaved reps; CP time = the slowest rank's.", "",
             f"Command: `{meta['command']}`", "",
             "| mode | candidate | ms | parallel efficiency (t_single / t) | GFLOP/s | % of peak | "
             "MiB sent per rank |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        sent = "—" if "ranks" not in r else " / ".join(f"{x['bytes_sent'] / 2**20:.0f}" for x in r["ranks"])
        lines.append(f"| {r['mode']} | {r['candidate']} | {r['ms']:.1f} | {r['efficiency']:.2f} | {r['gflops']:.1f} | "
                     f"{100 * r['gflops'] / peak:.0f}% | {sent} |")
    lines += ["", "Per rank and ring step (the last rep): kernel compute time, and the wait after it for the "
              "transfers (K/V of the next step; in backward also the dK/dV partial sums) — a wait near 0 means the "
              "transfer was hidden behind the compute.", "",
              "| mode | layout | rank | step | compute ms | wait ms | MiB sent |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        for rank, info in enumerate(r.get("ranks", [])):
            for s in info["steps"]:
                lines.append(f"| {r['mode']} ({s['pass']}) | {r['candidate'][3:]} | {rank} | {s['step']} | "
                             f"{s['compute_s'] * 1e3:.1f} | {s['wait_s'] * 1e3:.1f} | {s['bytes_sent'] / 2**20:.1f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
