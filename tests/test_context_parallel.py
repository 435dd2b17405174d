"""Context parallelism (attention_ext.distributed): every rank's shard of the result, its lse and
the gradients into its shards equal the single-process attention() on the full tensors — for both
layouts, every causal kind, n != m, GQA and any leading dims — run after run, bitwise; a K/V block
is never all-gathered; a bad argument on one rank is an exception on every rank, never a hang.

The ranks are real processes: torch.multiprocessing workers on loopback gloo (a free port per
group), each running the case functions below that the test sends it and returning numbers.
"""
from __future__ import annotations

import datetime
import multiprocessing
import os
import queue
import shutil
import tempfile
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import attention_ext
import attention_ext.distributed as cp
from attention_ext.distributed._layout import chunks, plan_calls

from conftest import SANITIZED, SLOW_BUILD

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is not available")

WORKER_IDLE_S = 300  # a worker nobody sends work to exits by itself
CASE_TIMEOUT_S = 600 if SLOW_BUILD else 180  # a hang, not a slow build
# Relative to the largest reference value; bf16 compares two bf16 computations (each block's partial
# result is rounded to bf16 before the float32 merge).
TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 5e-2}


# --- the worker group ------------------------------------------------------------------------------

def _worker(rank, world, rendezvous, tasks, results):
    if os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    # The ranks meet through a file, not a TCP port: a port found free here could be taken by a
    # parallel test before rank 0 binds it. (Under the sanitizer, with another pytest worker
    # beside them, starting the ranks can take minutes: hence the long timeout.)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    parent = multiprocessing.parent_process()
    idle = 0.0
    while idle < WORKER_IDLE_S and (parent is None or parent.is_alive()):
        try:
            item = tasks.get(timeout=1.0)
        except queue.Empty:
            idle += 1.0
            continue
        if item is None:
            break
        idle = 0.0
        fn, args = item
        try:
            results.put((rank, True, fn(rank, world, *args)))
        except BaseException as e:  # noqa: BLE001 - reported to the test, which decides
            results.put((rank, False, (type(e).__name__, str(e), traceback.format_exc())))
    dist.destroy_process_group()


class RankGroup:
    """`world` worker processes in one gloo group; run(fn, *args) runs fn(rank, world, *args) on
    every rank and returns the per-rank results, raising if any rank failed or timed out."""

    def __init__(self, world):
        ctx = mp.get_context("spawn")
        self.world = world
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.folder = tempfile.mkdtemp(prefix="attention_ext_ranks_")
        rendezvous = os.path.join(self.folder, "rendezvous")
        self.procs = [ctx.Process(target=_worker, args=(r, world, rendezvous, self.tasks[r], self.results),
                                  daemon=True) for r in range(world)]
        for p in self.procs:
            p.start()

    def outcomes(self, fn, *args):
        """[(ok, result or (exception name, message, traceback))] by rank."""
        for t in self.tasks:
            t.put((fn, args))
        got = {}
        deadline = time.monotonic() + CASE_TIMEOUT_S
        while len(got) < self.world:
            try:
                rank, ok, value = self.results.get(timeout=1.0)
                got[rank] = (ok, value)
                continue
            except queue.Empty:
                pass
            dead = [r for r, p in enumerate(self.procs) if not p.is_alive() and r not in got]
            if dead or time.monotonic() > deadline:
                self.close()
                missing = sorted(set(range(self.world)) - set(got))
                pytest.fail(f"{fn.__name__}: ranks {missing} did not answer "
                            + (f"(ranks {dead} exited)" if dead else f"in {CASE_TIMEOUT_S} s (a hang)"))
        return [got[r] for r in range(self.world)]

    def run(self, fn, *args):
        results = []
        for rank, (ok, value) in enumerate(self.outcomes(fn, *args)):
            if not ok:
                pytest.fail(f"rank {rank} raised {value[0]}: {value[1]}\n{value[2]}")
            results.append(value)
        return results

    def close(self):
        for t in self.tasks:
            t.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        shutil.rmtree(self.folder, ignore_errors=True)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda p: f"P{p}")
def group(request):
    g = RankGroup(request.param)
    yield g
    g.close()


@pytest.fixture(scope="module")
def pair():
    g = RankGroup(2)
    yield g
    g.close()


# --- what the ranks run -------------------------------------------------------------------------

def _full_problem(shape_q, shape_k, dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*shape_q, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(*shape_k, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(*shape_k[:-1], dv, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v, g


def _relative(got, want):
    got, want = got.double(), want.double()
    finite = torch.isfinite(want)
    if not torch.equal(finite, torch.isfinite(got)) or not torch.equal(got[~finite], want[~finite]):
        return float("inf")  # -inf lse rows must be -inf in both
    scale = want[finite].abs().max().item() if finite.any() else 1.0
    return (got[finite] - want[finite]).abs().max().item() / max(scale, 1e-30) if finite.any() else 0.0


def case_against_single_process(rank, world, layout, causal, dtype, shape_q, shape_k, dv, enable_gqa):
    """Max relative differences of out, lse, dq, dk, dv (this rank's shards) from attention() on the
    full tensors, with a loss that reaches both out and lse."""
    q, k, v, g = _full_problem(shape_q, shape_k, dv, dtype)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = attention_ext.attention(*full, causal=causal, enable_gqa=enable_gqa, return_lse=True)
    grad_out = torch.randn(out.shape, generator=g, dtype=torch.float64).to(dtype)
    grad_lse = torch.randn(lse.shape, generator=g, dtype=torch.float64).to(lse.dtype)
    torch.autograd.backward((out, lse), (grad_out, grad_lse.masked_fill(torch.isinf(lse), 0)))

    local = [cp.shard(t, layout).requires_grad_() for t in (q, k, v)]
    out_l, lse_l = cp.context_parallel_attention(*local, layout=layout, causal=causal, enable_gqa=enable_gqa,
                                                 return_lse=True)
    torch.autograd.backward((out_l, lse_l), (cp.shard(grad_out, layout),
                                             cp.shard(grad_lse.masked_fill(torch.isinf(lse), 0), layout, dim=-1)))
    return {
        "out": _relative(out_l, cp.shard(out.detach(), layout)),
        "lse": _relative(lse_l, cp.shard(lse.detach(), layout, dim=-1)),
        "dq": _relative(local[0].grad, cp.shard(full[0].grad, layout)),
        "dk": _relative(local[1].grad, cp.shard(full[1].grad, layout)),
        "dv": _relative(local[2].grad, cp.shard(full[2].grad, layout)),
    }


def case_in_subgroups(rank, world, layout):
    """The world split into rings of two ranks ({0, 1}, {2, 3}, ...), each on its own problem."""
    groups = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]  # every rank creates every group
    group = groups[rank // 2]
    q, k, v, g = _full_problem((2, 8, 16), (2, 12, 16), 16, torch.float64, seed=rank // 2)
    want, want_lse = attention_ext.attention(q, k, v, causal="bottom_right", return_lse=True)
    local = [cp.shard(t, layout, group) for t in (q, k, v)]
    out, lse = cp.context_parallel_attention(*local, group=group, layout=layout, causal="bottom_right",
                                             return_lse=True)
    return max(_relative(out, cp.shard(want, layout, group)),
               _relative(lse, cp.shard(want_lse, layout, group, dim=-1)))


def case_twice_bitwise(rank, world, layout, causal):
    q, k, v, g = _full_problem((2, 3, 16 * world, 24), (2, 3, 8 * world, 24), 24, torch.float32)
    runs = []
    for _ in range(2):
        local = [cp.shard(t, layout).requires_grad_() for t in (q, k, v)]
        out, lse = cp.context_parallel_attention(*local, layout=layout, causal=causal, return_lse=True)
        (out.square().sum() + lse.masked_fill(torch.isinf(lse), 0).sum()).backward()
        runs.append([out.detach(), lse.detach()] + [t.grad for t in local])
    return all(torch.equal(a, b) for a, b in zip(*runs))


def _peak_rss_growth(fn):
    """Peak resident memory growth (bytes) while fn runs: the kernel's high-water mark, reset first."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")

    def status(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))
    base = status("VmRSS:")
    fn()
    return status("VmHWM:") - base


def case_memory(rank, world):
    """Peak growth of one forward and of one forward+backward on shards of many keys and few queries:
    (forward growth, fwd+bwd growth, bytes of this rank's K+V shard)."""
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(4, 8, 64, generator=g)
    k = torch.randn(4, 32768, 64, generator=g)
    v = torch.randn(4, 32768, 64, generator=g)
    cp.context_parallel_attention(q, k, v)  # warm up: allocator and gloo pairs

    def forward():
        cp.context_parallel_attention(q, k, v)

    local = [t.clone().requires_grad_() for t in (q, k, v)]

    def forward_backward():
        cp.context_parallel_attention(*local).sum().backward()
    return _peak_rss_growth(forward), _peak_rss_growth(forward_backward), k.nbytes + v.nbytes


def case_step_log(rank, world, layout):
    q, k, v, _ = _full_problem((2, 8 * world, 16), (2, 8 * world, 16), 16, torch.float32)
    local = [cp.shard(t, layout).requires_grad_() for t in (q, k, v)]
    with cp.record_ring_steps() as steps:
        cp.context_parallel_attention(*local, layout=layout, causal="top_left").sum().backward()
    return [(s["pass"], s["step"], s["bytes_sent"]) for s in steps], local[1].nbytes + local[2].nbytes


def case_bad_key_on_rank_1(rank, world):
    q = torch.randn(2, 8, 16)
    k = torch.randn(2, 8, 16 if rank != 1 else 12)
    cp.context_parallel_attention(q, k, torch.randn(2, 8, 16))


def case_ranks_disagree_on_length(rank, world):
    n = 8 if rank == 0 else 6
    q = torch.randn(2, n, 16)
    cp.context_parallel_attention(q, q, q)


def case_bad_layout(rank, world):
    q = torch.randn(2, 8, 16)
    cp.context_parallel_attention(q, q, q, layout="striped")


def case_odd_zigzag_shard(rank, world):
    q = torch.randn(2, 7, 16)
    cp.context_parallel_attention(q, q, q, layout="zigzag")


def case_gqa_past_the_kernels_batch_dims_then_a_valid_call(rank, world):
    """enable_gqa's split makes 8 leading dims 9, past the kernels' 8 (attention() merges them, the
    ring does not): refused on every rank before the ring starts, and the group still works."""
    q, kv = torch.randn(*[1] * 7, 4, 8, 16), torch.randn(*[1] * 7, 2, 8, 16)
    try:
        cp.context_parallel_attention(q, kv, kv, enable_gqa=True)
        message = None
    except ValueError as e:
        message = str(e)
    x = torch.randn(2, 8, 16)
    return message, tuple(cp.context_parallel_attention(x, x, x).shape)


def case_grad_mode_differs(rank, world):
    """Rank 1 runs without autograd, the others record the call (and would wait for rank 1 in
    backward): refused on every rank before the ring starts."""
    q = torch.randn(2, 8, 16, requires_grad=True)
    with torch.set_grad_enabled(rank != 1):
        cp.context_parallel_attention(q, q, q)


def case_second_derivative(rank, world):
    """First-order gradients with create_graph=True, then a second derivative: refused on each rank,
    locally, after the ring's backward (no rank waits)."""
    q, k, v, _ = _full_problem((1, 2, 4 * world, 8), (1, 2, 4 * world, 8), 8, torch.float64)
    local = [cp.shard(t, "zigzag").requires_grad_() for t in (q, k, v)]
    out = cp.context_parallel_attention(*local, layout="zigzag", causal="top_left")
    (g,) = torch.autograd.grad(out.square().sum(), local[0], create_graph=True)
    torch.autograd.grad(g.sum(), local[0])


def case_unshard_bad_layout_on_rank_1(rank, world):
    cp.unshard(torch.randn(2, 4, 3), "zigzag" if rank != 1 else "diagonal")


def case_unshard_layouts_differ(rank, world):
    cp.unshard(torch.randn(2, 4, 3), "zigzag" if rank != 1 else "contiguous")


def case_not_a_member(rank, world):
    """group = ranks {0, 1}: a call from another rank is an error there, not a silent zero output."""
    group = dist.new_group([0, 1])
    if rank < 2:
        return None
    q = torch.randn(2, 8, 16)
    try:
        cp.context_parallel_attention(q, q, q, group=group)
    except ValueError as e:
        return str(e)
    return "no error"


def case_shard_indivisible(rank, world):
    cp.shard(torch.randn(2, 2 * world + 1, 4), "zigzag")


def case_shard_unshard(rank, world):
    """unshard(shard(x)) == x for both layouts and dims; unshard's gradient sums the ranks'."""
    x = torch.arange(2 * 4 * world * 3, dtype=torch.float64).reshape(2, 4 * world, 3)
    lse_like = torch.arange(5 * 4 * world, dtype=torch.float64).reshape(5, 4 * world)
    exact = all(torch.equal(cp.unshard(cp.shard(t, layout, dim=d), layout, dim=d), t)
                for layout in cp.LAYOUTS for t, d in ((x, -2), (lse_like, -1)))
    local = cp.shard(x, "zigzag").requires_grad_()
    (cp.unshard(local, "zigzag") * (rank + 1)).sum().backward()
    grad_ok = torch.equal(local.grad, torch.full_like(local, world * (world + 1) / 2))
    return exact, grad_ok


# --- the spec -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_matches_single_process_attention(group, layout, causal, dtype):
    P = group.world
    # n != m (fewer queries than keys), d_k != d_v, two leading dims.
    for rank_errors in group.run(case_against_single_process, layout, causal, dtype, (2, 3, 6 * P, 16),
                                 (2, 3, 10 * P, 16), 8, False):
        assert max(rank_errors.values()) <= TOLERANCE[dtype], rank_errors


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_more_queries_than_keys_bottom_right_rows_without_keys(group, layout):
    """bottom_right with n > m: the first n - m rows see no key — out 0, lse -inf, no gradient — on
    whichever rank they live."""
    P = group.world
    for rank_errors in group.run(case_against_single_process, layout, "bottom_right", torch.float64,
                                 (2, 10 * P, 8), (2, 4 * P, 8), 8, False):
        assert max(rank_errors.values()) <= TOLERANCE[torch.float64], rank_errors


@pytest.mark.parametrize("causal", ["top_left", "bottom_right"])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_grouped_query_attention(group, layout, causal):
    P = group.world
    for rank_errors in group.run(case_against_single_process, layout, causal, torch.float64,
                                 (2, 4, 8 * P, 16), (2, 2, 6 * P, 16), 16, True):
        assert max(rank_errors.values()) <= TOLERANCE[torch.float64], rank_errors


@pytest.mark.parametrize("shape_q,shape_k", [((4, 16), (6, 16)), ((2, 2, 3, 4, 8), (2, 2, 3, 6, 8)),
                                             ((2, 3, 4, 8), (1, 3, 6, 8)), ((1, 3, 4, 8), (2, 3, 6, 8))],
                         ids=["no_leading_dims", "three_leading_dims", "key_batch_broadcast", "query_batch_broadcast"])
def test_any_leading_dims(pair, shape_q, shape_k):
    # Rows are per rank: scale the shard lengths to the full sequence.
    full_q = (*shape_q[:-2], shape_q[-2] * 2, shape_q[-1])
    full_k = (*shape_k[:-2], shape_k[-2] * 2, shape_k[-1])
    for layout in cp.LAYOUTS:
        for rank_errors in pair.run(case_against_single_process, layout, "top_left", torch.float64, full_q, full_k,
                                    8, False):
            assert max(rank_errors.values()) <= TOLERANCE[torch.float64], rank_errors


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_a_subgroup_is_its_own_ring(group, layout):
    """group=: the ring runs over that group's ranks (global ranks for the transfers)."""
    for error in group.run(case_in_subgroups, layout):
        assert error <= TOLERANCE[torch.float64]


@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_run_twice_identical_bytes(group, layout, causal):
    assert all(group.run(case_twice_bitwise, layout, causal))


@pytest.mark.slow_on_emulation
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's peak-RSS reset")
@pytest.mark.skipif(SANITIZED,
                    reason="under AddressSanitizer freed blocks sit in ASan's quarantine, so peak RSS counts "
                           "buffers the ring has already released; the regular run measures it")
def test_memory_per_rank_is_far_below_an_all_gather_of_kv():
    """P = 4: an all-gather would hold all four K/V shards on every rank (4× the shard); the ring
    holds two blocks beyond its own (2×) in forward, and in backward also up to three dK/dV blocks —
    still below the all-gathered K/V plus their gradients that a non-ring backward keeps."""
    g = RankGroup(4)
    try:
        for forward, forward_backward, kv_bytes in g.run(case_memory):
            all_gather = 4 * kv_bytes
            assert forward <= 0.6 * all_gather, (forward / kv_bytes, "K/V shards of forward growth")
            assert forward_backward <= 0.7 * 2 * all_gather, (forward_backward / kv_bytes, "K/V shards, fwd+bwd")
    finally:
        g.close()


def test_step_log_bytes_sent(group):
    """Forward sends its K/V block P-1 times; backward also passes the dK/dV partial sums P times."""
    P = group.world
    for layout in cp.LAYOUTS:
        for steps, kv_bytes in group.run(case_step_log, layout):
            forward = [b for name, _, b in steps if name == "forward"]
            backward = [b for name, _, b in steps if name == "backward"]
            assert forward == [kv_bytes] * (P - 1) + [0]
            # dK/dV travel in the accumulation dtype: float32 here, the same bytes as K/V.
            assert backward == [2 * kv_bytes] * (P - 1) + [kv_bytes]


def test_bad_arguments_on_one_rank_fail_every_rank(group):
    outcomes = group.outcomes(case_bad_key_on_rank_1)
    assert not any(ok for ok, _ in outcomes)
    assert outcomes[1][1][0] == "ValueError" and "key" in outcomes[1][1][1]
    for rank, (_, (name, message, _)) in enumerate(outcomes):
        if rank != 1:
            assert name == "RuntimeError" and "rank 1" in message and "failed on another rank" in message


def test_a_rank_that_autograd_does_not_record_fails_every_rank(pair):
    for ok, (name, message, _) in pair.outcomes(case_grad_mode_differs):
        assert not ok and name == "ValueError" and "whether autograd records the call" in message


def test_a_second_derivative_raises_on_every_rank(pair):
    for ok, (name, message, _) in pair.outcomes(case_second_derivative):
        assert not ok and name == "NotImplementedError" and "first-order backward only" in message


def test_unshard_errors_reach_every_rank(pair):
    outcomes = pair.outcomes(case_unshard_bad_layout_on_rank_1)
    assert outcomes[1][1][0] == "ValueError" and "layout must be" in outcomes[1][1][1]
    assert outcomes[0][1][0] == "RuntimeError" and "rank 1" in outcomes[0][1][1]
    for ok, (name, message, _) in pair.outcomes(case_unshard_layouts_differ):
        assert not ok and name == "ValueError" and "same arguments" in message


def test_a_process_outside_the_group_gets_an_error():
    g = RankGroup(4)
    try:
        results = g.run(case_not_a_member)
    finally:
        g.close()
    assert results[:2] == [None, None]
    assert all("not a member of the group" in r for r in results[2:])


def test_gqa_past_the_kernels_batch_dims_is_refused_on_every_rank_before_the_ring(pair):
    for message, shape in pair.run(case_gqa_past_the_kernels_batch_dims_then_a_valid_call):
        assert message is not None and "at most 8 leading dims, got 9" in message and "enable_gqa" in message
        assert shape == (2, 8, 16)


def test_ranks_that_disagree_fail_every_rank(pair):
    for ok, (name, message, _) in pair.outcomes(case_ranks_disagree_on_length):
        assert not ok and name == "ValueError" and "same arguments" in message


@pytest.mark.parametrize("case,message", [
    (case_bad_layout, "layout must be 'contiguous' or 'zigzag'"),
    (case_odd_zigzag_shard, "both must be even"),
    (case_shard_indivisible, "needs a multiple of"),
])
def test_argument_errors(pair, case, message):
    for ok, (name, text, _) in pair.outcomes(case):
        assert not ok and name == "ValueError" and message in text


def test_shard_unshard_round_trip(group):
    for exact, grad_ok in group.run(case_shard_unshard):
        assert exact and grad_ok


def test_needs_an_initialised_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    q = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="needs torch.distributed initialised"):
        cp.context_parallel_attention(q, q, q)


# --- the block plan, without processes -----------------------------------------------------------

def _visible(n, m, causal):
    i = torch.arange(n)[:, None]
    j = torch.arange(m)[None, :]
    if causal is None:
        return torch.ones(n, m, dtype=torch.bool)
    return j <= i + (0 if causal == "top_left" else m - n)


def _covered(calls, n_local, m_local):
    """How many calls cover each (local query, local key) pair, by each call's window rule."""
    count = torch.zeros(n_local, m_local, dtype=torch.int64)
    for c in calls:
        n, m = c.q_hi - c.q_lo, c.k_hi - c.k_lo
        sees = _visible(n, m, None) if c.window_right < 0 else \
            torch.arange(m)[None, :] <= torch.arange(n)[:, None] + m - n + c.window_right
        count[c.q_lo:c.q_hi, c.k_lo:c.k_hi] += sees.long()
    return count


@pytest.mark.parametrize("P", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
@pytest.mark.parametrize("n_per_chunk,m_per_chunk", [(4, 4), (3, 5), (6, 2)])
def test_block_plan_covers_exactly_the_visible_pairs(P, layout, causal, n_per_chunk, m_per_chunk):
    pieces = P if layout == "contiguous" else 2 * P
    N, M = n_per_chunk * pieces, m_per_chunk * pieces
    visible = _visible(N, M, causal)
    offset = {None: None, "top_left": 0, "bottom_right": M - N}[causal]
    n_local, m_local = N // P, M // P
    for r in range(P):
        rows = torch.cat([torch.arange(c.global_start, c.global_start + c.size)
                          for c in chunks(layout, r, P, n_local)])
        for s in range(P):
            cols = torch.cat([torch.arange(c.global_start, c.global_start + c.size)
                              for c in chunks(layout, s, P, m_local)])
            calls = plan_calls(chunks(layout, r, P, n_local), chunks(layout, s, P, m_local), offset)
            assert torch.equal(_covered(calls, n_local, m_local), visible[rows][:, cols].long()), (r, s, calls)
            for c in calls:  # no call computes a rectangle nothing in it can see
                assert visible[rows[c.q_lo:c.q_hi]][:, cols[c.k_lo:c.k_hi]].any()


@pytest.mark.parametrize("P", [2, 4, 8])
def test_zigzag_balances_causal_work(P):
    """Causal with n == m: under zigzag every rank computes the same number of (query, key) pairs
    in at most one kernel call per step; under contiguous, rank r does r·c² + c(c+1)/2 for shards of
    c rows: the last rank almost 2P-1 times the first's."""
    N = 4 * 2 * P
    def pairs(layout, r):
        total = 0
        for s in range(P):
            calls = plan_calls(chunks(layout, r, P, N // P), chunks(layout, s, P, N // P), 0)
            if layout == "zigzag":
                assert len(calls) <= 1
            total += int(_covered(calls, N // P, N // P).sum())
        return total
    zigzag = [pairs("zigzag", r) for r in range(P)]
    contiguous = [pairs("contiguous", r) for r in range(P)]
    assert len(set(zigzag)) == 1
    assert sum(zigzag) == sum(contiguous) == N * (N + 1) // 2
    c = N // P
    assert contiguous == [r * c * c + c * (c + 1) // 2 for r in range(P)]


# --- the op contract the ring relies on -----------------------------------------------------------

@pytest.mark.parametrize("n", [3, 12])
def test_backward_with_a_merged_lse_takes_p_from_it(n):
    """attention_bwd(..., merged_lse=True): P = exp(S - lse) with the lse as given — one block of an
    attention whose softmax spans more keys — even where the backward would otherwise recompute the
    row's own normaliser (few rows; |lse| large)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, s, 8, generator=g, dtype=torch.float64) for s in (n, 10, 10))
    grad_out = torch.randn(2, n, 8, generator=g, dtype=torch.float64)
    out = torch.randn(2, n, 8, generator=g, dtype=torch.float64)  # the merged output: not this block's
    for shift in (3.0, 40.0):
        lse = torch.randn(2, n, generator=g, dtype=torch.float64) + shift
        scale = 8 ** -0.5
        p = torch.exp(q @ k.transpose(-1, -2) * scale - lse[..., None])
        ds = p * (grad_out @ v.transpose(-1, -2) - (grad_out * out).sum(-1, keepdim=True))
        want = (ds @ k * scale, ds.transpose(-1, -2) @ q * scale, p.transpose(-1, -2) @ grad_out)
        got = torch.ops.attention_ext.attention_bwd(grad_out, None, q, k, v, None, out, lse, scale, 0, -1, -1, 0.0,
                                                    None, None, 0.0, None, False, True)
        for a, b in zip(got[:3], want):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


# --- the README's example ---------------------------------------------------------------------------

@pytest.mark.slow_on_emulation
@pytest.mark.skipif(tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 5),
                    reason="torch 2.4's gloo can deadlock in destroy_process_group at exit (its ProcessGroupGloo "
                           "destructor joins worker threads while holding the GIL; pytorch/pytorch#154976): seen "
                           "in 2 of 6 runs of this example there, after both ranks had printed their results")
def test_readme_torchrun_example_runs(tmp_path):
    """The README's context-parallel example, run as it says (torchrun, two processes)."""
    import re
    import subprocess
    import sys
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    block = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.DOTALL) if "torchrun" in b)
    command = re.search(r"run with: (torchrun .*)", block).group(1).split()
    assert command[:3] == ["torchrun", "--nproc-per-node", "2"] and command[-1] == "ring.py"
    (tmp_path / "ring.py").write_text(block)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if os.path.exists("/sys/class/net/lo"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # --standalone: a free local rendezvous port, so parallel test runs do not collide.
    # --tee 3: each rank's output also goes to its own file. The two processes share the console
    # pipe, and one rank's print can land in the middle of the other's line there.
    logs = tmp_path / "logs"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--tee", "3", "--log-dir", str(logs), *command[1:]],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    # Everything both processes and the launcher said: a failure here has to explain itself.
    assert run.returncode == 0, (f"torchrun exited {run.returncode}\n--- stdout ---\n{run.stdout[-3000:]}\n"
                                 f"--- stderr ---\n{run.stderr[-12000:]}")
    rank_outputs = sorted(logs.rglob("stdout.log"))
    assert len(rank_outputs) == 2, (rank_outputs, run.stdout)
    printed = sorted(line for path in rank_outputs for line in path.read_text().splitlines()
                     if "torch.Size" in line)
    assert printed == ["0 torch.Size([1, 8, 4096, 64])", "1 torch.Size([1, 8, 4096, 64])"], run.stdout
