"""Finite differences on every CPU kernel path, at sizes that cross tile boundaries.

The CPU ops pick among several kernels (csrc/cpu/kernel_passes.cpp):
  * forward, tiled: work items of kBlockM = 64 query rows, inner tiles of kBlockN = 64 keys
    (csrc/cpu/kernel_table.h), with the online softmax rescaling across key tiles;
  * forward, decode: at most kDecodeRows = 8 query rows, K/V rows read in place;
  * forward, decode with split keys: when there are few (batch, head) pairs and m >= 1024, the
    keys are cut into ranges whose partial results are merged by their log-sum-exp;
  * backward, fused (one pass per key owner) or split (a dK/dV pass and a dQ pass): the tiled
    backward;
  * backward, decode: at most kDecodeRows query rows (the query not broadcast, no mask gradient),
    S and dP as row dot products over K/V rows read in place, the keys of few (batch, head) pairs
    in ranges whose partial dQ are summed in range order.
ATTENTION_EXT_CPU_FORWARD=tiled and ATTENTION_EXT_CPU_BACKWARD=fused|split|decode force a path; the
split-key decode is chosen by the shape alone. Each path is checked here with float64
torch.autograd.gradcheck (and gradgradcheck, which differentiates the first-order backward
kernels numerically) on 65 to 130 rows / keys, so a second or third tile is always partial, with
each feature that changes the kernels' inner loops: both causal alignments, bool and float masks
(with the mask's own gradient), dropout, grouped-query attention, a broadcast query and the lse
output. The last section checks that each forced path is the one that actually ran: by its bits
for the forwards, by its peak memory for the backward schedules (their results are bitwise equal).

The bfloat16 forward with AVX512-BF16 dot products (forward_bf16_dot.inc) has no float64 twin: it
exists for bf16 storage only, so it cannot be finite-differenced; test_forward compares it with the
float64 reference on every variant the machine supports.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck

import attention_ext
from attention_ext import attention

from conftest import SLOW, rand

# The switches and the kernels' selection rules are the CPU kernels' own.
pytestmark = pytest.mark.cpu_kernels

TILE = 64           # kBlockM = kBlockN in csrc/cpu/kernel_table.h
DECODE_ROWS = 8     # kDecodeRows: calls with at most this many query rows take the decode forward
SPLIT_KEYS = 1030   # >= 2 * kMinSplitKeys (512): one (batch, head) pair gets two key ranges
DK, DV = 3, 2       # small, and d_k != d_v so a swapped dimension cannot pass
SCHEDULES = ["fused", "split"]
CAUSAL_SHAPES = [   # (causal, n, m): each alignment with a partial last tile
    (None, 65, 130),
    ("top_left", 70, 70),       # the tile above the diagonal is skipped
    ("bottom_right", 65, 130),  # every query sees past the first key tile
    ("bottom_right", 130, 65),  # the whole first query tile sees no key
]


@pytest.fixture(autouse=True)
def one_thread():
    """gradcheck makes thousands of small calls, where waking the thread pool costs more than the
    kernel (on a loaded 2-core machine 15 ms a call instead of 0.8 ms). Results do not depend on
    the thread count (test_determinism.py), and each path here is forced, not chosen by it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def force(monkeypatch):
    """force(forward="tiled", backward="fused"|"split"): sets the switches for this test."""
    def set_paths(forward=None, backward=None):
        for name, value in (("ATTENTION_EXT_CPU_FORWARD", forward), ("ATTENTION_EXT_CPU_BACKWARD", backward)):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
    return set_paths


def qkv(n, m, q_batch=(1, 1), kv_batch=(1, 1), dk=DK, dv=DV):
    return (rand(*q_batch, n, dk, requires_grad=True), rand(*kv_batch, m, dk, requires_grad=True),
            rand(*kv_batch, m, dv, requires_grad=True))


def visible_rows(causal, n, m):
    """Rows that see at least one key (the others have lse = -inf, which has no finite difference)."""
    if causal == "bottom_right":
        return slice(max(0, n - m), n)
    return slice(0, n)


def with_lse(rows, **kw):
    """fn(q, k, v[, attn_mask]) = attention(..., **kw) returning out and the lse of `rows`, so a
    gradient through the lse reaches the backward too."""
    def fn(q, k, v, *mask):
        call = dict(kw, attn_mask=mask[0]) if mask else kw
        out, lse = attention(q, k, v, return_lse=True, **call)
        return out, lse[..., rows]
    return fn


def reseeded(fn, seed=0):
    """gradcheck calls fn many times: re-seed so every call draws the same dropout mask. (Only the
    CPU generator, which the CPU ops draw from: torch.manual_seed costs ~1 ms, the call itself less.)"""
    def wrapped(*args):
        torch.default_generator.manual_seed(seed)
        return fn(*args)
    return wrapped


# ----------------------------------------------------------------------------------------------
# Tiled forward, each backward schedule.

@pytest.mark.parametrize("causal,n,m", CAUSAL_SHAPES, ids=lambda x: str(x))
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_tiled_forward_gradcheck(force, schedule, causal, n, m):
    force(forward="tiled", backward=schedule)
    fn = with_lse(visible_rows(causal, n, m), causal=causal)
    assert gradcheck(fn, qkv(n, m))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_tiled_forward_gradcheck_gqa(force, schedule):
    # Two query heads share one key/value head: dK and dV sum over the heads (in the fused
    # schedule, one key owner accumulates dQ for both query heads).
    force(forward="tiled", backward=schedule)
    q, k, v = qkv(65, 70, q_batch=(1, 2), kv_batch=(1, 1))
    fn = lambda q, k, v: attention(q, k, v, causal="bottom_right", enable_gqa=True)  # noqa: E731
    assert gradcheck(fn, (q, k, v))


def test_tiled_forward_gradcheck_broadcast_query():
    # A query broadcast over the batch always takes the split schedule (dQ sums over the batch).
    q, k, v = qkv(65, 70, q_batch=(1, 1), kv_batch=(2, 1))
    assert gradcheck(lambda q, k, v: attention(q, k, v, causal="top_left"), (q, k, v))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_tiled_forward_gradcheck_bool_mask(force, schedule):
    force(forward="tiled", backward=schedule)
    n, m = 65, 130
    mask = torch.rand(n, m) < 0.7
    mask[64] = False          # a fully masked row in the second query tile
    mask[:, 64:128] = False   # a fully masked key tile between two that take part
    fn = with_lse(slice(0, 64), attn_mask=mask, causal="bottom_right")
    assert gradcheck(fn, qkv(n, m))


@pytest.mark.parametrize("layout", ["heads_outer", "heads_inner"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_tiled_forward_gradcheck_rows_read_in_place(force, schedule, layout):
    # A whole tile of 64 query rows whose Q and dO rows are dense float64 vectors already (d = 8,
    # unit column stride, rows d apart) is read in place by the backward's products; rows a head
    # apart in a (batch, sequence, heads, d) layout, and the partial second query tile, go through
    # the packed copy. The whole first key tile, with no mask, takes P and dS in one pass; the
    # partial second one the general passes.
    force(forward="tiled", backward=schedule)
    n, m, d = 65, 70, 8
    if layout == "heads_outer":
        q, k, v = qkv(n, m, dk=d, dv=d)
    else:
        q, k, v = (rand(1, s, 2, d).transpose(1, 2).requires_grad_() for s in (n, m, m))
    assert gradcheck(with_lse(slice(0, n)), (q, k, v))


# The mask's gradient is one kernel (backward_mask) after either schedule: (mask shape, whether
# every entry is finite-differenced). A full (n, m) mask has 8450 entries: entry by entry only
# with ATTENTION_EXT_SLOW_TESTS=1, else in one random direction.
FLOAT_MASKS = [((65, 130), SLOW), ((1, 130), True), ((65, 1), True), ((2, 1, 1, 130), True)]


@pytest.mark.parametrize("mask_shape,full", FLOAT_MASKS, ids=lambda x: str(x))
def test_tiled_forward_gradcheck_float_mask_with_its_gradient(force, mask_shape, full):
    force(forward="tiled")
    n, m = 65, 130
    q, k, v = qkv(n, m, q_batch=(2, 1), kv_batch=(2, 1))
    mask = rand(*mask_shape)
    rows = slice(0, n)
    if mask_shape == (n, m):
        mask[1, TILE:] = float("-inf")  # row 1 sees only the first key tile
        mask[-1, :] = float("-inf")     # the last row sees nothing (its gradients are 0)
        rows = slice(0, n - 1)
    # (-inf entries are fine for finite differences: -inf ± eps is -inf.)
    mask.requires_grad_()
    fn = with_lse(rows, causal="bottom_right")
    # Through the mask and the query (entry by entry when `full`), then through every input in
    # one random direction.
    k_fixed, v_fixed = k.detach(), v.detach()
    assert gradcheck(lambda q, mask: fn(q, k_fixed, v_fixed, mask), (q, mask), fast_mode=not full)
    assert gradcheck(fn, (q, k, v, mask), fast_mode=True)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_tiled_forward_gradcheck_dropout(force, schedule):
    force(forward="tiled", backward=schedule)
    fn = reseeded(lambda q, k, v: attention(q, k, v, causal="bottom_right", dropout_p=0.3))
    assert gradcheck(fn, qkv(65, 70))


# ----------------------------------------------------------------------------------------------
# Decode forward (n <= 8), one key range and split keys; the tiled forward forced on few rows.

# Each causal kind once; the backward (the same kernels as after the tiled forward) alternates.
@pytest.mark.parametrize("causal,schedule",
                         [(None, "fused"), ("top_left", "split"), ("bottom_right", "fused")])
def test_decode_forward_gradcheck(force, schedule, causal):
    force(backward=schedule)
    fn = with_lse(slice(0, 3), causal=causal)
    assert gradcheck(fn, qkv(3, 130))


@pytest.mark.parametrize("causal", [None, "bottom_right"])
def test_tiled_forward_forced_on_decode_rows_gradcheck(force, causal):
    force(forward="tiled")
    assert gradcheck(with_lse(slice(0, DECODE_ROWS), causal=causal), qkv(DECODE_ROWS, 130))


@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
def test_split_key_decode_gradcheck(causal):
    # top_left with 3 rows: the second key range sees no key at all and must drop out of the
    # merge; bottom_right: every row sees keys of both ranges.
    q, k, v = qkv(3, SPLIT_KEYS)
    fn = with_lse(slice(0, 3), causal=causal)
    # Entry by entry through the query (the merge is in the forward, so a wrong merge shows in
    # dout/dq and in dlse/dq); K and V have thousands of entries, checked in one random direction.
    k_fixed, v_fixed = k.detach(), v.detach()
    assert gradcheck(lambda q: fn(q, k_fixed, v_fixed), (q,))
    assert gradcheck(fn, (q, k, v), fast_mode=True)


def test_split_key_decode_gradcheck_with_mask_and_dropout():
    q, k, v = qkv(2, SPLIT_KEYS, q_batch=(1, 2), kv_batch=(1, 2))
    mask = rand(2, 1, SPLIT_KEYS, requires_grad=True)
    fn = reseeded(lambda q, k, v, mask: attention(q, k, v, attn_mask=mask, dropout_p=0.2))
    k_fixed, v_fixed, mask_fixed = k.detach(), v.detach(), mask.detach()
    assert gradcheck(lambda q: fn(q, k_fixed, v_fixed, mask_fixed), (q,))
    assert gradcheck(fn, (q, k, v, mask), fast_mode=True)


# ----------------------------------------------------------------------------------------------
# Decode backward (n <= 8, no mask gradient), one key range and split keys (partial dQ summed).
# (The checks above with a schedule forced run the tiled backward on decode-sized calls.)

@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
def test_decode_backward_gradcheck(force, causal):
    force(backward="decode")
    assert gradcheck(with_lse(slice(0, 3), causal=causal), qkv(3, 130))


def test_decode_backward_gradcheck_with_every_modifier_and_gqa(force):
    # Two query heads per K/V head (dK and dV sum the group), a bool mask, a sliding window, the
    # softcap, ALiBi, sinks (with their gradient), dropout: each changes how P is rebuilt.
    force(backward="decode")
    q, k, v = qkv(3, 130, q_batch=(1, 4), kv_batch=(1, 2))
    mask = torch.rand(3, 130, generator=torch.Generator().manual_seed(3)) < 0.8
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    sinks = rand(4, requires_grad=True)
    fn = reseeded(lambda q, k, v, sinks: attention(q, k, v, attn_mask=mask, window=(100, 2), softcap=3.0,
                                                   alibi_slopes=slopes, sinks=sinks, dropout_p=0.2, enable_gqa=True))
    assert gradcheck(fn, (q, k, v, sinks))


@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
def test_decode_backward_split_keys_gradcheck(force, causal):
    # top_left: the second key range sees no query row (its dK and dV are zeros).
    force(backward="decode")
    q, k, v = qkv(3, SPLIT_KEYS)
    fn = with_lse(slice(0, 3), causal=causal)
    k_fixed, v_fixed = k.detach(), v.detach()
    assert gradcheck(lambda q: fn(q, k_fixed, v_fixed), (q,))
    assert gradcheck(fn, (q, k, v), fast_mode=True)


# ----------------------------------------------------------------------------------------------
# Second order: the double backward is a torch composition, checked against finite differences
# of the fused first-order backward on each path.

GRADGRAD_CASES = {
    "tiled-fused": dict(forward="tiled", backward="fused", n=65, m=130),
    "tiled-split": dict(forward="tiled", backward="split", n=65, m=130),
    "decode": dict(forward=None, backward="fused", n=3, m=130),
    "decode-split-keys": dict(forward=None, backward="split", n=3, m=SPLIT_KEYS),
}


@pytest.mark.parametrize("case", GRADGRAD_CASES, ids=str)
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
def test_gradgradcheck_on_each_path(force, case, causal):
    c = GRADGRAD_CASES[case]
    force(forward=c["forward"], backward=c["backward"])
    q, k, v = qkv(c["n"], c["m"], q_batch=(1, 2), kv_batch=(1, 1))
    mask = rand(c["n"], c["m"], requires_grad=True)
    fn = reseeded(lambda q, k, v, mask: attention(q, k, v, attn_mask=mask, causal=causal, dropout_p=0.2,
                                                  enable_gqa=True))
    assert gradgradcheck(fn, (q, k, v, mask), fast_mode=True)


# ----------------------------------------------------------------------------------------------
# Every ISA variant: the same paths in one random direction each (the variants differ in vector
# width, so in tile padding and in which K/V rows are read in place).

@pytest.mark.parametrize("forward,n,m", [("tiled", 65, 130), (None, 3, 130), (None, 3, SPLIT_KEYS)],
                         ids=["tiled", "decode", "decode-split-keys"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_gradcheck_fast_on_every_variant(force, cpu_variant, schedule, forward, n, m):
    force(forward=forward, backward=schedule)
    # d_k = 8 is a whole number of float64 vectors on every variant (K rows read in place where
    # the path does that), d_v = 5 is not (V rows converted into a padded tile).
    q, k, v = qkv(n, m, q_batch=(1, 2), kv_batch=(1, 1), dk=8, dv=5)
    mask = rand(n, m, requires_grad=True)
    for causal in (None, "top_left", "bottom_right"):
        fn = reseeded(lambda q, k, v, mask: attention(q, k, v, attn_mask=mask, causal=causal, dropout_p=0.2,
                                                      enable_gqa=True))
        assert gradcheck(fn, (q, k, v, mask), fast_mode=True), (cpu_variant, causal)


@pytest.mark.parametrize("n,m", [(3, 130), (3, SPLIT_KEYS)], ids=["decode", "decode-split-keys"])
def test_decode_backward_gradcheck_fast_on_every_variant(force, cpu_variant, n, m):
    force(backward="decode")
    q, k, v = qkv(n, m, q_batch=(1, 2), kv_batch=(1, 1), dk=8, dv=5)
    mask = torch.rand(n, m, generator=torch.Generator().manual_seed(2)) < 0.8
    for causal in (None, "top_left", "bottom_right"):
        fn = reseeded(lambda q, k, v: attention(q, k, v, attn_mask=mask, causal=causal, dropout_p=0.2,
                                                enable_gqa=True))
        assert gradcheck(fn, (q, k, v), fast_mode=True), (cpu_variant, causal)


# ----------------------------------------------------------------------------------------------
# The forced path is the one that ran. Without these, a switch the binding stopped reading
# would leave the checks above testing the default path twice.

def test_forced_tiled_forward_runs_instead_of_decode(force):
    # The two forwards sum in different orders, so their results differ in the last bits.
    q, k, v = (t.detach().float()
               for t in qkv(DECODE_ROWS, 130, q_batch=(2, 2), kv_batch=(2, 2), dk=64, dv=64))
    force()
    decode = attention(q, k, v, return_lse=True)
    force(forward="tiled")
    tiled = attention(q, k, v, return_lse=True)
    for a, b in zip(decode, tiled):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=0)
        assert not torch.equal(a, b), "ATTENTION_EXT_CPU_FORWARD=tiled gave the decode forward's bits"


def test_forced_tiled_backward_runs_instead_of_decode(force):
    # The decode backward's dot products sum in other orders than the tiled backward's GEMMs.
    q, k, v = (t.detach().float().requires_grad_()
               for t in qkv(DECODE_ROWS, 130, q_batch=(2, 2), kv_batch=(2, 2), dk=64, dv=64))

    def grads():
        out = attention(q, k, v)
        return torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    force()
    decode = grads()
    force(backward="fused")
    tiled = grads()
    for a, b in zip(decode, tiled):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
    assert any(not torch.equal(a, b) for a, b in zip(decode, tiled)), \
        "ATTENTION_EXT_CPU_BACKWARD=fused gave the decode backward's bits"


def test_split_key_shape_takes_the_split_path():
    # The same problem once alone (two key ranges merged) and as one of 64 (batch, head) pairs
    # (one range each, no merge): the merge rounds differently. Each pair has K/V of its own (a
    # broadcast K/V would make the pairs rows of shared work items, split like the single pair).
    q, k, v = (t.detach() for t in qkv(3, SPLIT_KEYS, dv=16))
    alone = attention(q, k, v)
    in_batch = attention(*(t.expand(64, 1, -1, -1).contiguous() for t in (q, k, v)))
    torch.testing.assert_close(alone, in_batch[:1], atol=1e-13, rtol=0)
    assert not torch.equal(alone, in_batch[:1]), f"{SPLIT_KEYS} keys for one pair did not split the keys"


def _peak_rss_growth(fn):
    """Bytes the resident set grew to at its peak while fn() ran (Linux: /proc/self/clear_refs
    resets the peak to the current size)."""
    def hwm():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = hwm()
    fn()
    return hwm() - base


def _can_reset_peak_rss():
    try:
        _peak_rss_growth(lambda: None)
        return True
    except OSError:
        return False


# The backward schedules give bitwise identical gradients, so memory tells them apart: the fused
# one holds dQ for all of its key owner's query rows in scratch (n x d_k accumulators), the split
# one only a tile. bottom_right with n >> m leaves all but the last query tile without a visible
# key, so the large n costs almost no arithmetic.
PEAK_N, PEAK_M, PEAK_DK = 2 ** 17, 64, 80  # float32: dQ is 40 MiB per head, the fused scratch 40 MiB


def backward_peak_growth(schedule, heads):
    """Peak resident-memory growth (bytes) of one float32 backward, one thread, with
    ATTENTION_EXT_CPU_BACKWARD=schedule."""
    os.environ["ATTENTION_EXT_CPU_BACKWARD"] = schedule
    q = torch.ones(1, heads, PEAK_N, PEAK_DK, requires_grad=True)
    k, v = torch.randn(1, heads, PEAK_M, PEAK_DK), torch.randn(1, heads, PEAK_M, 1)
    out = attention(q, k, v, causal="bottom_right")
    grad_out = torch.ones_like(out)
    backward = lambda: torch.autograd.grad(out, q, grad_out, retain_graph=True)  # noqa: E731
    backward()  # the first large backward of a process maps ~35 MiB of its own
    return min(_peak_rss_growth(backward), _peak_rss_growth(backward))


@pytest.fixture(scope="module")
def backward_peaks():
    """backward_peak_growth of each (schedule, heads), measured in a fresh process: in this one,
    earlier tests may have left hundreds of MiB of freed heap (a failing fast-mode gradcheck
    builds whole Jacobians to report), which a large allocation reuses without growing the
    resident set. The child imports the attention_ext this process imported; glibc's mmap
    threshold is pinned at 1 MiB there, so every large buffer is fresh pages and its free an
    munmap (which records the peak)."""
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(attention_ext.__file__)))
    pythonpath = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=pythonpath, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="1048576")
    proc = subprocess.run([sys.executable, __file__, "--backward-peaks"], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, f"the measuring process failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["attention_ext_file"] == os.path.abspath(attention_ext.__file__)
    return result["peaks"]


@pytest.mark.skipif(not _can_reset_peak_rss(),
                    reason="needs Linux's /proc/self/clear_refs to measure the backward's peak memory")
@pytest.mark.parametrize("heads", [1, 2], ids=["one_key_owner", "two_key_owners"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_forced_backward_schedule_is_the_one_that_ran(backward_peaks, schedule, heads):
    # With one thread, one key owner defaults to split and two to fused, so each forced schedule
    # is checked where the default would be the other one.
    growth = backward_peaks[f"{schedule}-{heads}"]
    grad_q_bytes = heads * PEAK_N * PEAK_DK * 4
    scratch_bytes = PEAK_N * PEAK_DK * 4
    ran = "fused" if growth > grad_q_bytes + scratch_bytes / 2 else "split"
    mib = 2 ** 20
    assert ran == schedule, (f"ATTENTION_EXT_CPU_BACKWARD={schedule}: peak memory grew by {growth / mib:.1f} "
                             f"MiB (dQ {grad_q_bytes / mib:.0f} MiB, fused scratch {scratch_bytes / mib:.0f} "
                             f"MiB): the {ran} schedule ran")


if __name__ == "__main__" and sys.argv[1:] == ["--backward-peaks"]:  # the backward_peaks child
    torch.set_num_threads(1)
    peaks = {f"{schedule}-{heads}": backward_peak_growth(schedule, heads)
             for schedule in SCHEDULES for heads in (1, 2)}
    print(json.dumps(dict(attention_ext_file=os.path.abspath(attention_ext.__file__), peaks=peaks)))
