"""The benchmark scripts run end to end (their numbers are measured elsewhere: benchmarks/README.md).
The GPU benchmark has a CPU dry run (tiny shapes, the backends torch has on the CPU) so that the
script a GPU session depends on is exercised on every machine."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

import attention_ext
from conftest import SANITIZED, cpuinfo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def env_importing_this_attention_ext():
    """The benchmark imports whichever attention_ext Python finds: make it the one under test (a
    scratch copy's in-place build, say, rather than an installed one). And it runs as a smoke run
    (shortened machine probes: ATTENTION_EXT_BENCH_SMOKE, benchmarks/README.md)."""
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(attention_ext.__file__)))
    path = [package_root] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path), ATTENTION_EXT_BENCH_SMOKE="1")


@pytest.mark.slow_on_emulation
def test_gpu_benchmark_dry_run_writes_every_row_and_the_targets(tmp_path):
    prefix = tmp_path / "results_gpu"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_gpu.py"), "--device", "cpu",
                           "--dry-run", "--dtypes", "float32", "--modes", "fwd,bwd", "--d", "64", "--out", str(prefix)],
                          capture_output=True, text=True, timeout=600, env=env_importing_this_attention_ext())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads((tmp_path / "results_gpu.json").read_text())
    rows = result["rows"]
    assert len(rows) == 2 * 2 * 2  # shapes x causal x modes
    assert result["meta"]["status"] == "complete" and result["meta"]["rows_planned"] == len(rows)
    assert all(r["ms"]["ours"] > 0 for r in rows)
    assert {r["mode"] for r in rows} == {"fwd", "bwd"}
    # Backends torch lacks on the CPU are listed as not measured, not dropped silently.
    assert all("efficient" in r["error"] or "efficient" in r["ms"] for r in rows)
    md = (tmp_path / "results_gpu.md").read_text()
    assert "## Targets" in md and "| float32 | fwd |" in md


def run_bench(tmp_path, *args):
    """benchmarks/bench.py on one tiny shape (one rep, 1 ms samples, no sweep): its JSON and markdown."""
    prefix = tmp_path / "results"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench.py"), *args, "--reps", "1",
                           "--warmup", "1", "--min-sample-ms", "1", "--no-sweep", "--out", str(prefix)],
                          capture_output=True, text=True, timeout=600, env=env_importing_this_attention_ext())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads((tmp_path / "results.json").read_text()), (tmp_path / "results.md").read_text()


@pytest.mark.slow_on_emulation
def test_benchmark_measures_the_machine_and_reports_percent_of_its_peak(tmp_path):
    # One tiny shape, forward only: the point is the harness (machine measurements, table, JSON).
    result, md = run_bench(tmp_path, "--shapes", "1x2x64x64x16", "--mode", "fwd", "--no-memory", "--no-naive")
    assert result["fma_peak"]["gflops"] > 0 and result["bandwidth"]["gbps"] > 0
    assert result["fma_peak"]["variant"] == attention_ext.cpu_variant()
    (row,) = result["rows"]
    assert row["pct_peak"]["ours"] == pytest.approx(100.0 * row["gflops"]["ours"] / result["fma_peak"]["gflops"])
    assert "measured FMA peak" in md and "ours % peak" in md and "family" in result["meta"]["cpu"]


@pytest.mark.slow_on_emulation
def test_benchmark_times_the_backward_the_naive_composition_and_each_candidate_s_memory(tmp_path):
    """The parts the harness test above leaves out: fwd+bwd, the naive candidate, the memory
    subprocesses and the end-of-run peaks, on one causal shape with fewer queries than keys
    (top-left causal: 8²/2 visible pairs, not 8·64/2)."""
    result, md = run_bench(tmp_path, "--shapes", "1x2x8x64x16c", "--mode", "both", "--threads", "1")
    fwd, fwdbwd = result["rows"]
    assert (fwd["mode"], fwdbwd["mode"]) == ("fwd", "fwdbwd")
    assert fwd["flops"] == 4.0 * 2 * (8 ** 2 / 2) * 16 and fwdbwd["flops"] == 3.5 * fwd["flops"]
    for row in result["rows"]:
        assert set(row["median_ms"]) == {"ours", "torch", "naive"} and "ours/naive" in row["ratio"]
        assert all("error" not in m and m["extra_mib"] >= 0 for m in row["mem"].values()), row["mem"]
    fma = result["fma_peak"]
    assert fma["gflops"] == max(fma["start_gflops"], fma["end_gflops"])
    assert "measured at the start" in md


@pytest.mark.slow_on_emulation
def test_benchmark_times_calls_in_a_model_layer_s_layout(tmp_path):
    """--layout model: (B, n, H·d) inputs viewed through a transpose and the output reshaped back;
    every candidate agrees with ours there, in both modes, memory included."""
    result, md = run_bench(tmp_path, "--shapes", "2x3x8x24x16c", "--mode", "both", "--threads", "1", "--layout",
                           "model")
    assert result["meta"]["layout"] == "model" and "a model layer's layout" in md
    assert [row["mode"] for row in result["rows"]] == ["fwd", "fwdbwd"]
    for row in result["rows"]:
        assert row["maxdiff"] < 1e-5 and set(row["median_ms"]) == {"ours", "torch", "naive"}
        assert all("error" not in m and m["extra_mib"] >= 0 for m in row["mem"].values()), row["mem"]


def test_the_read_probe_reports_a_plausible_rate_and_refuses_what_it_cannot_read():
    """cpu_stream_read_gbps: a rate between 0.1 GB/s and 10 TB/s (its speed is the benchmarks'
    business, not a unit test's); a clear error for a buffer it cannot read; measure_bandwidth
    takes the larger of the probe and torch's sum."""
    import torch
    probe = torch.ops.attention_ext.cpu_stream_read_gbps
    assert 0.1 < probe(torch.ones(2 ** 24)) < 10_000
    for bad in (torch.ones(100), torch.ones(2 ** 20, dtype=torch.float64), torch.ones(2 ** 21)[::2]):
        with pytest.raises(RuntimeError, match="cpu_stream_read_gbps reads a contiguous float32 CPU tensor"):
            probe(bad)
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import bench
    finally:
        sys.path.pop(0)
    bw = bench.measure_bandwidth(mib=64, reps=2)
    assert bw["gbps"] == max(bw["probe_gbps"], bw["torch_sum_gbps"]) and bw["method"]


@pytest.mark.parametrize("probe, short_iterations", [("cpu_fma_peak_gflops", 2_000_000),
                                                     ("cpu_tile_gemm_gflops", 2_000),
                                                     ("cpu_tile_forward_gflops", 2_000),
                                                     ("cpu_tile_backward_gflops", 800)])
def test_cpu_probes_count_their_flops(probe, short_iterations):
    # The probe is timed by the op; a run of 10x the iterations must take longer, not report the
    # same time. On a shared machine a run can only be slowed down, never sped up: the fastest of
    # several short runs is the honest short time (one preempted short run once failed this).
    import time

    import torch
    op = getattr(torch.ops.attention_ext, probe)

    def seconds(iterations):
        t0 = time.perf_counter()
        result = op(iterations)
        return time.perf_counter() - t0, result
    short = min(seconds(short_iterations)[0] for _ in range(5))
    long, gflops = seconds(10 * short_iterations)
    assert gflops > 0 and long > 3 * short
    with pytest.raises(RuntimeError, match="iterations must be positive"):
        op(0)


@pytest.mark.skipif(SANITIZED, reason="under ASan/UBSan the probes' loads and arithmetic are instrumented unevenly: "
                    "their relative speeds say nothing about the optimised build's ceilings")
def test_each_ceiling_is_under_the_one_it_adds_work_to():
    # FMA peak > tile GEMM > forward tile, and tile GEMM > backward tile: all count 2 flops per FMA
    # of the same vectors; the tile GEMM feeds its FMAs from memory, so it cannot beat independent
    # register chains, and the forward-tile and backward-tile probes run the same GEMM's products
    # (two, five) plus the elementwise work between them (the online-softmax step; P and dS) for
    # the products' flop count. Best of three each, interleaved: a preempted run reads low, and a
    # busy spell of the machine then hits all four. On one thread: a probe on every thread runs at
    # its slowest thread's pace, so another pytest worker's process on one core halved whichever
    # probe it met (the FMA peak once read 109 GFLOP/s against the tile GEMM's 133 that way).
    import torch
    ops = torch.ops.attention_ext
    fma, gemm, forward, backward = [], [], [], []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(3):
            fma.append(ops.cpu_fma_peak_gflops(2_000_000))
            gemm.append(ops.cpu_tile_gemm_gflops(4_000))
            forward.append(ops.cpu_tile_forward_gflops(4_000))
            backward.append(ops.cpu_tile_backward_gflops(1_600))
    finally:
        torch.set_num_threads(threads)
    assert 0 < max(gemm) <= 1.2 * max(fma)
    assert 0 < max(forward) <= 1.2 * max(gemm)
    assert 0 < max(backward) <= 1.2 * max(gemm)


@pytest.mark.slow_on_emulation
def test_window_benchmark_writes_a_row_per_window_and_mode(tmp_path):
    prefix = tmp_path / "window"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_window.py"), "--length", "160",
                           "--heads", "1", "--d", "16", "--windows", "8,full", "--reps", "1", "--out", str(prefix)],
                          capture_output=True, text=True, timeout=600, env=env_importing_this_attention_ext())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads((tmp_path / "window.json").read_text())
    assert [(r["window"], r["mode"]) for r in result["rows"]] == [(8, "fwd"), (8, "fwdbwd"), (None, "fwd"),
                                                                  (None, "fwdbwd")]
    # visible pairs of a causal window (8, 0) over 160 queries: 1 + 2 + ... + 9, then 9 per row
    assert result["rows"][0]["visible_pairs"] == 45 + 9 * 151
    assert result["rows"][2]["visible_pairs"] == 160 * 161 // 2
    assert "| 8 | fwd |" in (tmp_path / "window.md").read_text()


def test_interleaved_timing_shuffles_each_round_and_runs_before_right_before_each_timed_call():
    """time_interleaved (bench_window.py; the window, varlen and KV-cache benchmarks time with it):
    each step timed `reps` times after its warm-up calls, before(step) run right before each timed
    call of step, and every round in its own order, so that no step always follows the same one (a
    step that evicts the caches would otherwise slow only the step after it)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        from bench_window import time_interleaved
    finally:
        sys.path.pop(0)
    calls = []
    steps = {name: (lambda name=name: calls.append(("call", name))) for name in "abcde"}
    medians = time_interleaved(steps, 5, 1, before=lambda step: calls.append(("before", step)))
    assert set(medians) == set("abcde") and all(t >= 0 for t in medians.values())
    assert calls[:5] == [("call", name) for name in "abcde"]  # the warm-up, nothing before it
    timed = calls[5:]
    assert len(timed) == 2 * 5 * 5
    for (kind, step), (kind_after, name) in zip(timed[0::2], timed[1::2]):
        assert (kind, kind_after) == ("before", "call") and step is steps[name]
    names = [name for _, name in timed[1::2]]
    rounds = [names[5 * r:5 * r + 5] for r in range(5)]
    assert all(sorted(order) == list("abcde") for order in rounds)
    after = {name: {names[i - 1] for i in range(1, len(names)) if names[i] == name} for name in "abcde"}
    assert all(len(steps_before) > 1 for steps_before in after.values()), after  # (in the calls' sequence)


@pytest.mark.slow_on_emulation
def test_varlen_benchmark_times_every_candidate_in_both_modes(tmp_path):
    prefix = tmp_path / "varlen"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_varlen.py"), "--lengths",
                           "70,33,1", "--heads", "2", "--d", "16", "--reps", "1", "--out", str(prefix)],
                          capture_output=True, text=True, timeout=600, env=env_importing_this_attention_ext())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads((tmp_path / "varlen.json").read_text())
    candidates = ["ours packed", "ours padded causal", "torch padded causal", "ours padded + mask", "torch padded + mask",
                  "torch loop"]
    assert [(r["candidate"], r["mode"]) for r in result["rows"]] == [(c, m) for m in ("fwd", "fwdbwd")
                                                                     for c in candidates]
    assert all(r["ms"] > 0 for r in result["rows"])
    assert all(r["max_diff"] < 1e-4 for r in result["rows"]), "every candidate computes the same real rows"
    assert "| ours packed | fwd |" in (tmp_path / "varlen.md").read_text()


@pytest.mark.slow_on_emulation
def test_context_parallel_benchmark_times_both_layouts_and_logs_every_step(tmp_path):
    prefix = tmp_path / "cp"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_context_parallel.py"),
                           "--length", "256", "--heads", "1", "--d", "16", "--reps", "1", "--out", str(prefix)],
                          capture_output=True, text=True, timeout=600, env=env_importing_this_attention_ext())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads((tmp_path / "cp.json").read_text())
    assert [(r["mode"], r["candidate"]) for r in result["rows"]] == [
        (m, c) for m in ("fwd", "fwdbwd") for c in ("single", "cp zigzag", "cp contiguous")]
    for row in result["rows"][1:]:
        if row["candidate"] != "single":
            assert len(row["ranks"]) == 2 and all(r["bytes_sent"] > 0 for r in row["ranks"])
    assert "| fwd | cp zigzag |" in (tmp_path / "cp.md").read_text()


@pytest.mark.slow_on_emulation
def test_kvcache_benchmark_times_every_layout_the_append_and_the_rotary(tmp_path):
    prefix = tmp_path / "kv"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_kvcache.py"), "--lengths", "512",
                           "--batches", "1x2", "--rows", "1", "--dtypes", "float32", "--heads-per-kv", "2",
                           "--reps", "1", "--warmup", "0", "--out", str(prefix)],
                          capture_output=True, text=True, timeout=600, env=env_importing_this_attention_ext())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads((tmp_path / "kv.json").read_text())
    (row,) = result["rows"]
    assert set(row["results"]) == {"ours contiguous", "ours paged 16", "ours paged 256", "torch sliced",
                                   "torch gathered"}
    assert row["kv_bytes"] == 2 * 2 * 512 * 64 * 4 and all(r["gbps"] > 0 for r in row["results"].values())
    assert set(result["append_rows"][0]["ms"]) == {"attend", "append + attend", "write only", "append + rotary + attend"}
    text = (tmp_path / "kv.md").read_text()
    assert "% of bandwidth" in text and "Heads = 2 x kv_heads (GQA)" in text and result["meta"]["heads_per_kv"] == 2
    assert row["read_beside_gbps"] is None and "read beside" not in text  # (only with --read-beside)
    # --read-beside: each row also against the machine's read timed before each of its calls
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_kvcache.py"), "--lengths", "256",
                           "--batches", "1x2", "--rows", "1", "--dtypes", "float32", "--reps", "2", "--warmup", "1",
                           "--read-beside", "--out", str(tmp_path / "beside")],
                          capture_output=True, text=True, timeout=600, env=env_importing_this_attention_ext())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (row,) = json.loads((tmp_path / "beside.json").read_text())["rows"]
    text = (tmp_path / "beside.md").read_text()
    assert row["read_beside_gbps"] > 0 and "| % of the read beside |" in text and "out of the caches" in text
    assert row["read_beside_reads"] == 2 * len(row["results"])  # one read before every timed call


@pytest.mark.slow_on_emulation
def test_kvcache_benchmark_times_another_variant_beside_and_refuses_an_unsupported_one(tmp_path):
    prefix = tmp_path / "kv"
    args = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_kvcache.py"), "--lengths", "256", "--batches",
            "1x2", "--rows", "2", "--dtypes", "bfloat16", "--reps", "1", "--warmup", "0"]
    proc = subprocess.run(args + ["--also-variant", "generic", "--out", str(prefix)], capture_output=True, text=True,
                          timeout=600, env=env_importing_this_attention_ext())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads((tmp_path / "kv.json").read_text())
    (row,) = result["rows"]
    assert "ours contiguous, generic" in row["results"] and row["results"]["ours contiguous, generic"]["gbps"] > 0
    assert "| ours contiguous, generic |" in (tmp_path / "kv.md").read_text()
    proc = subprocess.run(args + ["--also-variant", "nonesuch"], capture_output=True, text=True, timeout=600,
                          env=env_importing_this_attention_ext())
    assert proc.returncode == 2 and "--also-variant nonesuch: this CPU and build support" in proc.stderr
    # caches of fp16 too; a dtype it does not time is named with the ones it does
    fp16 = args[:args.index("--dtypes")] + ["--dtypes", "float16", "--reps", "1", "--warmup", "0"]
    proc = subprocess.run(fp16, capture_output=True, text=True, timeout=600, env=env_importing_this_attention_ext())
    assert proc.returncode == 0 and re.search(r"float16 +256 1x2 rows 2: ours contiguous", proc.stdout), proc.stderr[-2000:]
    proc = subprocess.run(args + ["--dtypes", "float64"], capture_output=True, text=True, timeout=600,
                          env=env_importing_this_attention_ext())
    assert proc.returncode == 2 and "--dtypes float64: unknown float64; choose from float32, bfloat16, float16" in proc.stderr


def test_call_overhead_benchmark_times_our_call_its_parts_and_the_floors(tmp_path):
    prefix = tmp_path / "overhead"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_call_overhead.py"), "--shape",
                           "1x2x3x20x16", "--reps", "1", "--out", str(prefix)],
                          capture_output=True, text=True, timeout=600, env=env_importing_this_attention_ext())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads((tmp_path / "overhead.json").read_text())
    groups = result["results"]
    assert len(groups) == 3 and all(row[0] > 0 for rows in groups.values() for row in rows.values())
    backward = groups["backward (autograd.grad of a kept graph)"]
    assert "floor: engine + one C++ node (x * 2)" in backward and "ours" in backward
    assert "µs" in (tmp_path / "overhead.md").read_text()


def test_call_overhead_benchmark_times_a_gqa_call_beside_torch_s(tmp_path):
    prefix = tmp_path / "gqa"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_call_overhead.py"), "--shape",
                           "1x4x1x20x16", "--kv-heads", "2", "--reps", "1", "--out", str(prefix)],
                          capture_output=True, text=True, timeout=600, env=env_importing_this_attention_ext())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads((tmp_path / "gqa.json").read_text())
    assert result["kv_heads"] == 2
    forward = result["results"]["forward, no autograd"]
    torch_row = [name for name in forward if name.startswith("torch SDPA (")]
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import bench
    finally:
        sys.path.pop(0)
    assert torch_row == ["torch SDPA (enable_gqa)" if bench.TORCH_SDPA_GQA else
                         "torch SDPA (K/V repeat_interleave'd: no enable_gqa)"]
    assert set(forward) - set(torch_row) in ({"ours", "the op alone (direct entry)"},
                                             {"ours", "the op alone (torch.ops (JIT build: no direct entry))"})
    assert all(row[0] > 0 for rows in result["results"].values() for row in rows.values())
    text = (tmp_path / "gqa.md").read_text()
    assert "--kv-heads 2" in text and "median of 1 interleaved" in text
    assert "{" not in text, "a placeholder was left unformatted"


def test_call_overhead_benchmark_times_a_decode_step_beside_torch_s(tmp_path):
    prefix = tmp_path / "step"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_call_overhead.py"), "--shape",
                           "2x4x1x20x16", "--kv-heads", "2", "--kvcache", "--reps", "1", "--out", str(prefix)],
                          capture_output=True, text=True, timeout=600, env=env_importing_this_attention_ext())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads((tmp_path / "step.json").read_text())
    step = result["results"]["decode step against a KV cache, no autograd"]
    assert {"ours: attend", "ours: append n rows, attend", "ours: rotary, append n rows, attend",
            "torch: SDPA over the cache", "torch: write n rows (slice assignment), SDPA",
            "torch: rotary (torch ops), write n rows, SDPA"} < set(step)
    assert all(row[0] > 0 for row in step.values())
    assert "--kvcache" in (tmp_path / "step.md").read_text()


@pytest.mark.slow_on_emulation
@pytest.mark.parametrize("kv_cache", [False, True], ids=["heads_major", "kv_cache"])
def test_decode_in_cache_benchmark_reports_cycles_per_key_at_a_plausible_clock(kv_cache):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "decode_in_cache.py"), "--tokens", "16",
                           "--rows", "2", "--heads-per-kv", "1", "--seconds", "0"] + (["--kv-cache"] if kv_cache else []),
                          capture_output=True, text=True, timeout=600, env=env_importing_this_attention_ext())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "cycles per (key, KV head)" in proc.stdout and "2 query row(s) x 1 heads per KV head" in proc.stdout
    assert ("one KV cache" in proc.stdout) == kv_cache
    # The clock comes from the FMA peak and the variant's vector width: a variant missing from the
    # width table once made it 14 GHz (cycle counts 4x too high). (No lower bound: under the
    # sanitizers the probe runs far below the machine's clock.)
    ghz = float(re.search(r"at ([0-9.]+) GHz", proc.stdout).group(1))
    assert 0 < ghz < 7, proc.stdout


def _build_and_run_micro_benchmark(tmp_path, name, flags, *args):
    """Compiles benchmarks/<name>.cpp with g++ (warnings as errors) and runs it with the arguments;
    returns its stdout's lines."""
    if SANITIZED:  # (they time the machine, and the sanitizer job's other worker loads it: two flaked there)
        pytest.skip("built without sanitizers and timed: the sanitizer job adds nothing to them; the other jobs "
                    "run them")
    exe = tmp_path / name
    # The programs are built without sanitizers: a runtime preloaded into this process (the
    # sanitizer job's) would interpose their allocator and time that instead.
    env = {key: value for key, value in os.environ.items() if key != "LD_PRELOAD"}
    build = subprocess.run(["g++", *flags, "-Wall", "-Werror", "-o", str(exe),
                            os.path.join(ROOT, "benchmarks", name + ".cpp")],
                           capture_output=True, text=True, timeout=600, env=env)
    assert build.returncode == 0, build.stderr[-4000:]
    proc = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.splitlines()


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_decode_prefetch_micro_benchmark_builds_and_fills_its_tables(tmp_path):
    lines = _build_and_run_micro_benchmark(tmp_path, "decode_prefetch", ["-O3", "-march=native"], "1024")
    # the prefetch schemes: GB/s per work level
    assert lines[0].startswith("one thread, GB/s") and lines[1].split()[:3] == ["work", "FMAs", "none"]
    schemes = [line.split() for line in lines[2:6]]
    assert [row[0] for row in schemes] == ["0", "2", "4", "6"]
    assert all(len(row) == 8 and all(float(x) > 0 for x in row[2:]) for row in schemes)
    # memory and work apart and together: ns per row, and the overlap from work 2 on
    assert lines[6] == "" and lines[7].startswith("ns per 256-byte row")
    header = lines.index(next(line for line in lines if line.startswith("work") and "overlap" in line))
    overlap = [line.split() for line in lines[header + 1:header + 5]]
    assert [row[0] for row in overlap] == ["0", "2", "4", "6"]
    assert all(len(row) == 8 and all(float(x) > 0 for x in row[2:7]) for row in overlap)
    # storage order, ranges side by side: GB/s per work level and range count
    side = lines.index(next(line for line in lines if line.startswith("storage order, R ranges")))
    assert lines[side + 1].split() == ["work", "FMAs", "R=1", "R=2", "R=4", "R=8"]
    ranges = [line.split() for line in lines[side + 2:side + 6]]
    assert [row[0] for row in ranges] == ["0", "2", "4", "6"]
    assert all(len(row) == 6 and all(float(x) > 0 for x in row[2:]) for row in ranges)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_decode_overlap_micro_benchmark_builds_and_fills_its_table(tmp_path):
    threads = 2
    lines = _build_and_run_micro_benchmark(tmp_path, "decode_overlap", ["-O3", "-march=native", "-fopenmp"],
                                           str(threads), "1024")
    if len(lines) == 1 and lines[0].endswith("nothing to time"):
        pytest.skip(lines[0])
    assert lines[0].startswith("2 thread(s), each with 1024 tokens x 8 heads x d 64")
    read = re.search(r"median of 7\): ([0-9.]+) GB/s before the table, ([0-9.]+)", lines[1])
    assert read and float(read.group(1)) > 0 and float(read.group(2)) > 0, lines[1]
    read = max(float(read.group(1)), float(read.group(2)))
    assert lines[3].split() == ["order", "work", "memory", "together", "GB/s", "%", "of", "read", "overlap"]
    rows = lines[4:14]
    assert [row.split()[0] for row in rows] == ["kernel,"] * 5 + ["sequential", "kernel,", "kernel,", "8", "kernel,"]
    assert [" ".join(row.split()[:3]) for row in rows[6:8]] == ["kernel, paged 16", "kernel, paged 256"]
    assert rows[8].startswith("8 ranges, K by key ") and rows[9].startswith("kernel, strands ")
    for row in rows:
        work, memory, together, gbps, share, overlap = (float(x) for x in row.split()[-6:])
        assert work > 0 and memory > 0 and together > 0, row
        # GB/s: 512 bytes of K and V per (key, K/V head) and thread in `together` ns; % of read:
        # its share of the plain read's (the larger of the two). Each agrees within the printed
        # roundings: together's 0.005 ns, the rate's 0.05 GB/s, read's 0.05 GB/s, the share's 0.5 %.
        exact_gbps = 512 * threads / together
        assert abs(gbps - exact_gbps) <= 0.05 + exact_gbps * 0.005 / together + 1e-6, row
        exact_share = 100 * exact_gbps / read
        assert abs(share - exact_share) <= 0.5 + exact_share * (0.005 / together + 0.05 / read) + 1e-6, row
        # (from the printed values, each rounded to 0.01: the numerator's three, the divisor's, the result's)
        smaller = min(work, memory)
        tolerance = (0.015 + 0.005 * abs(overlap)) / smaller + 0.006
        assert abs(overlap - (work + memory - together) / smaller) <= tolerance, row
    # the bf16 loops' table where the CPU has AVX512-BF16 (256 bytes of K and V per (key, K/V head))
    if lines[14:] == ["", "(no AVX512-BF16 here: no bf16 table)"]:
        return
    assert lines[14] == "" and lines[15].startswith("bf16 K and V of the same shape"), lines[14:]
    bf16_read = re.search(r"read: ([0-9.]+) GB/s before, ([0-9.]+) after", lines[16])
    assert bf16_read and float(bf16_read.group(1)) > 0, lines[16]
    assert lines[17].split() == ["order", "work", "memory", "together", "GB/s", "%", "of", "read", "overlap"]
    names = ["bf16, next chunk/head", "bf16, paged 16", "bf16, paged 256", "bf16, strands", "bf16, strands, paged 16"]
    assert len(lines[18:]) == len(names), lines[18:]
    for row, name in zip(lines[18:], names):
        work, memory, together, gbps, share, overlap = (float(x) for x in row.split()[-6:])
        assert row.startswith(name) and work > 0 and memory > 0 and together > 0, row
        exact_gbps = 256 * threads / together
        assert abs(gbps - exact_gbps) <= 0.05 + exact_gbps * 0.005 / together + 1e-6, row


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_read_order_micro_benchmark_builds_and_fills_its_table(tmp_path):
    lines = _build_and_run_micro_benchmark(tmp_path, "read_order", ["-O3", "-march=native", "-fopenmp"],
                                           "2", "1024", "3")
    assert lines[0].startswith("2 thread(s), each with 1024 tokens x 8 heads x d 64")
    assert lines[2].split() == ["order", "median", "%", "of", "read", "rounds"]
    rows = {line[:26].strip(): line[26:].split() for line in lines[3:]}
    assert list(rows) == ["plain, 8 parts", "plain, 1 part", "plain, 16 parts", "chunk by head",
                          "chunk by head, no asks", "key by key", "strands", "8 ranges, chunk by head",
                          "8 ranges, key/head/range", "4 ranges, key/head/range", "8 ranges, key/range"]
    reference = sorted(float(x) for x in rows["plain, 8 parts"][2:])[1]
    for name, (median, share, *rounds) in rows.items():
        rates = sorted(float(x) for x in rounds)
        assert len(rates) == 3 and rates[0] > 0, name
        # the median of the three rounds, and its share of the 8-part read's median (each printed
        # to 0.1 GB/s and 1 %: the share from printed rates is off by at most the rounding of both)
        assert float(median) == pytest.approx(rates[1], abs=0.051), name
        slack = 0.5 + 100 * 0.05 / reference * (1 + rates[1] / reference) + 1e-6
        assert float(share) == pytest.approx(100 * rates[1] / reference, abs=slack), name
    assert rows["plain, 8 parts"][1] == "100"


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_bf16_dot_throughput_micro_benchmark_builds_and_reports(tmp_path):
    lines = _build_and_run_micro_benchmark(tmp_path, "bf16_dot_throughput", ["-O2"], "200000")
    if len(lines) == 1 and lines[0].endswith("nothing to time"):
        pytest.skip(lines[0])
    assert lines[0].startswith("one thread, GFLOP/s") and len(lines) == 5
    rows = {line.rsplit(None, 1)[0].split(" (")[0]: float(line.rsplit(None, 1)[1]) for line in lines[1:4]}
    assert set(rows) == {"fp32 FMA", "bf16 dot product", "dot / FMA"}
    assert rows["fp32 FMA"] > 0 and rows["bf16 dot product"] > 0
    assert rows["dot / FMA"] == pytest.approx(rows["bf16 dot product"] / rows["fp32 FMA"], abs=0.01)
    # AMX tiles: a rate where the CPU has them (and the kernel grants the tile state), else why not
    amx = lines[4].split(")", 1)[1].strip()
    assert lines[4].startswith("bf16 AMX tiles (tdpbf16ps)")
    assert amx.startswith("n/a: ") or float(amx) > 0
    if "amx_bf16" in cpuinfo().get("flags", "").split():
        assert not amx.startswith("n/a: no AMX"), lines[4]


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_exp2_throughput_micro_benchmark_builds_and_reports(tmp_path):
    lines = _build_and_run_micro_benchmark(tmp_path, "exp2_throughput", ["-O2"], "2000")
    if len(lines) == 1 and lines[0].endswith("nothing to time"):
        pytest.skip(lines[0])
    assert lines[0].startswith("one thread, ns per vector") and lines[1].split()[0] == "form"
    rows = {line.split()[0]: line.split()[1:] for line in lines[2:]}
    assert set(rows) == {"round", "reduce", "floor"}
    assert all(float(row[0]) > 0 for row in rows.values())
    # the kernels' form (reduce) gives the previous form's bits; the floor form does not
    assert rows["round"][3] == "yes" and rows["reduce"][3] == "yes" and rows["floor"][3] == "no"
    assert float(rows["reduce"][2]) < 1.0 < float(rows["floor"][2]) < 1.5


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_amx_tile_throughput_micro_benchmark_builds_and_reports(tmp_path):
    lines = _build_and_run_micro_benchmark(tmp_path, "amx_tile_throughput", ["-O2", "-mamx-tile", "-mamx-bf16"], "3")
    if len(lines) == 1 and lines[0].endswith("nothing to measure"):
        assert "amx_bf16" not in cpuinfo().get("flags", "").split() or "refused" in lines[0], lines[0]
        pytest.skip(lines[0])
    assert len(lines) == 4, lines
    assert lines[0].startswith("TDPBF16PS") and lines[1].startswith("tile load")
    assert float(lines[0].split(":")[1].split()[0]) > 0 and float(lines[1].split(":")[1].split()[0]) > 0
    for line, rows in zip(lines[2:], (16, 32)):
        assert line.startswith(f"S for {rows} rows x 64 keys, d = 128"), line
        times = [float(x) for x in re.findall(r"([0-9.]+) ns", line)]
        assert len(times) == 2 and all(t > 0 for t in times), line
