"""Argument fuzzing: thousands of random, mostly invalid calls to scaled_dot_product_attention,
attention, attention_weights and the raw ops either raise a clear Python exception or return the
float64 reference's answer — and never crash the process.

The fuzz loop (tests/fuzz_driver.py) runs in subprocesses, seeded, so a segfault or abort is
caught and reported with the arguments of the call that caused it (the driver logs each call
before making it). Replay one call with
    python tests/fuzz_driver.py --seed S --start I --iterations 1 --verbose

The tests at the end pin down what the fuzzer found: validation added to attention_ext/api.py,
and the crashes it found, each replayed in a subprocess.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

import attention_ext

from conftest import SLOW, SLOW_BUILD

DRIVER = Path(__file__).with_name("fuzz_driver.py")
# The folder holding the attention_ext package this process imported.
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(attention_ext.__file__)))
SEEDS = [0, 1]
ITERATIONS = 12_000 if SLOW else 1_200
TIMEOUT_S = 900 if SLOW or SLOW_BUILD else 300  # per driver: a hang, not a slow machine
ops = torch.ops.attention_ext


@dataclass
class FuzzRun:
    seed: int
    returncode: int
    stdout: str
    stderr: str
    log: str
    timed_out: bool = False
    summary: dict = field(default_factory=dict)

    @property
    def last_call(self):
        calls = [line for line in self.log.splitlines() if line.startswith("CALL ")]
        return calls[-1] if calls else "(no call logged)"

    def replay(self, line):
        index = line.split()[1] if line.startswith("CALL ") else "I"
        return f"python tests/fuzz_driver.py --seed {self.seed} --start {index} --iterations 1 --verbose"


def child_env(**extra):
    """Environment for a subprocess that must import the attention_ext this process imported (a
    checkout, an editable or a normal install), not whatever its own location would put first."""
    pythonpath = os.pathsep.join(p for p in (PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=pythonpath, **extra)


def start_driver(seed, log_path, iterations, start=0, inject=None):
    """The driver in a subprocess (so a crash cannot take pytest down)."""
    cmd = [sys.executable, str(DRIVER), "--seed", str(seed), "--start", str(start),
           "--iterations", str(iterations), "--log", str(log_path)]
    if inject:
        cmd += ["--inject", inject]
    # One thread each: the runs go side by side on a small machine.
    env = child_env(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def finish(proc, seed, log_path, timeout=TIMEOUT_S):
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        timed_out = True
    log = log_path.read_text() if log_path.exists() else ""
    run = FuzzRun(seed, proc.returncode, out, err, log, timed_out)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if lines:
        run.summary = json.loads(lines[-1])
    return run


def problems(run):
    """What is wrong with a fuzz run, in words (empty if nothing)."""
    if run.timed_out:
        return [f"seed {run.seed}: no answer within the time limit; the last call started was\n  "
                f"{run.last_call}\n  replay: {run.replay(run.last_call)}"]
    if run.returncode not in (0, 1):
        how = (f"killed by {signal.Signals(-run.returncode).name}" if run.returncode < 0
               else f"exited with status {run.returncode}")
        return [f"seed {run.seed}: the fuzz process {how} during\n  {run.last_call}\n"
                f"  replay: {run.replay(run.last_call)}\n  stderr tail: {run.stderr[-2000:]}"]
    out = []
    for line in run.stdout.splitlines():
        if line.startswith("FAIL "):
            index = line.split()[1].rstrip(":")
            call = next((c for c in run.log.splitlines() if c.startswith(f"CALL {index} ")), "")
            out.append(f"seed {run.seed}: {line}\n  {call}\n  replay: {run.replay(call)}")
    if run.returncode == 1 and not out:
        out.append(f"seed {run.seed}: the driver failed without a report:\n"
                   f"{run.stdout[-2000:]}{run.stderr[-2000:]}")
    return out


# Every fuzz subprocess of this file, started together (they are mostly import time and run side
# by side on a small machine): name -> driver arguments.
JOBS = {
    **{f"seed{seed}": dict(seed=seed, iterations=ITERATIONS) for seed in SEEDS},
    # Harness self-checks: a crash at call 4, the same call replayed alone, every result corrupted.
    "crash": dict(seed=3, iterations=10, inject="crash:4"),
    "replay": dict(seed=3, start=4, iterations=1, inject="crash:4"),
    "wrong": dict(seed=4, iterations=80, inject="wrong:-1"),
}


@pytest.fixture(scope="module")
def fuzz_runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz")
    logs = {name: folder / f"{name}.log" for name in JOBS}
    procs = {name: start_driver(log_path=logs[name], **job) for name, job in JOBS.items()}
    return {name: finish(proc, JOBS[name]["seed"], logs[name]) for name, proc in procs.items()}


@pytest.mark.parametrize("seed", SEEDS)
def test_fuzzed_calls_raise_a_clear_exception_or_return_the_reference_answer(fuzz_runs, seed):
    run = fuzz_runs[f"seed{seed}"]
    found = problems(run)
    assert not found, f"{len(found)} fuzzed calls went wrong:\n" + "\n".join(found[:20])
    # The fuzz reaches both sides: plenty of calls refused for each reason class, plenty of
    # calls answered and checked against the reference, for each entry point.
    s = run.summary
    assert s["attention_ext_file"] == os.path.abspath(attention_ext.__file__), (
        "the fuzz subprocess imported another attention_ext than the tests", s["attention_ext_file"])
    assert s["iterations"] == ITERATIONS and not s["failed"]
    # Valid calls (no mutation) are a sizeable share, and none of them may raise.
    assert s["valid"] >= 0.1 * ITERATIONS, s
    assert s["raised"] >= 0.35 * ITERATIONS and s["returned"] >= 0.25 * ITERATIONS, s
    for kind in ("TypeError", "ValueError", "RuntimeError"):
        assert s.get(f"raised:{kind}", 0) >= 0.02 * ITERATIONS, (kind, s)
    for fn in ("sdpa", "attention", "weights", "op_fwd", "op_probs", "op_bwd", "op_dropout_mask"):
        assert s.get(f"returned:{fn}", 0) >= 0.01 * ITERATIONS, (fn, s)


# ----------------------------------------------------------------------------------------------
# The harness itself: a crash, and a wrong answer, are caught and reported.

def test_a_crash_in_a_call_is_reported_with_that_calls_arguments(fuzz_runs):
    run = fuzz_runs["crash"]
    assert run.returncode == -signal.SIGABRT
    found = problems(run)
    assert len(found) == 1
    assert "killed by SIGABRT" in found[0] and "CALL 4 " in found[0]
    assert "--seed 3 --start 4 --iterations 1" in found[0]
    # The report carries the arguments: the logged description of call 4.
    assert run.last_call.startswith("CALL 4 ") and "Tensor(shape=" in run.last_call


def test_replaying_the_reported_call_alone_makes_the_same_call(fuzz_runs):
    """Call I is a function of (seed, I) alone: --start I --iterations 1 reproduces it."""
    crash, replay = fuzz_runs["crash"], fuzz_runs["replay"]
    assert replay.returncode == -signal.SIGABRT
    assert replay.last_call == crash.last_call


def test_a_wrong_answer_is_reported(fuzz_runs):
    # Every result that returns is corrupted (+1): each must be flagged.
    run = fuzz_runs["wrong"]
    assert run.returncode == 1
    s = run.summary
    checked = s["returned"] - sum(v for k, v in s.items() if k.startswith("known:"))
    assert checked >= 20, s
    # Results with no floating entries (bool dropout masks, empty or meta tensors) cannot be corrupted.
    assert len(s["failed"]) >= 0.6 * checked, s
    assert any("max abs error" in msg for msg in problems(run))


# ----------------------------------------------------------------------------------------------
# Validation the fuzzer showed missing (now in attention_ext/api.py).

def t(*shape, dtype=torch.float32):
    return torch.randn(shape).to(dtype)


def test_causal_bias_of_other_sizes_than_the_problem_raises_value_error():
    # torch refuses it too; before, the bias's sizes were silently ignored.
    with pytest.raises(ValueError, match=r"CausalBias attn_mask is for 3 queries and 10 keys, but query has 5"):
        attention_ext.scaled_dot_product_attention(t(2, 5, 4), t(2, 7, 4), t(2, 7, 3),
                                                   attn_mask=causal_lower_right(3, 10))


@pytest.mark.parametrize("fn", ["attention", "attention_weights"])
def test_causal_bias_given_to_the_extended_api_raises_type_error(fn):
    # A CausalBias is a Tensor subclass over uninitialised memory: it used to be read as a float mask.
    args = (t(2, 5, 4), t(2, 7, 4)) + ((t(2, 7, 3),) if fn == "attention" else ())
    with pytest.raises(TypeError, match=r"take causal='top_left' or 'bottom_right' instead of a CausalBias"):
        getattr(attention_ext, fn)(*args, attn_mask=causal_upper_left(5, 7))


def test_causal_bias_made_by_a_tensor_operation_raises_type_error():
    try:
        broken = causal_lower_right(3, 5).clone()  # torch returns the subclass without its fields
    except NotImplementedError:
        pytest.skip("this torch's CausalBias refuses tensor operations (torch 2.4): no such object arises")
    with pytest.raises(TypeError, match=r"CausalBias without its variant"):
        attention_ext.scaled_dot_product_attention(t(3, 4), t(5, 4), t(5, 2), attn_mask=broken)


def test_gqa_mask_with_a_heads_dim_of_the_key_value_heads_raises_value_error():
    # Torch broadcasts the mask against the query heads (4 here): 2 does not broadcast to 4.
    q, k, v = t(1, 4, 3, 16), t(1, 2, 7, 16), t(1, 2, 7, 8)
    with pytest.raises(ValueError, match=r"heads dim \(-3\) must be 1 or the query heads \(4\)"):
        attention_ext.attention(q, k, v, attn_mask=torch.zeros(1, 2, 3, 7), enable_gqa=True)
    # 1 and 4 are fine and match the reference.
    for heads in (1, 4):
        mask = torch.randn(1, heads, 3, 7)
        out = attention_ext.attention(q, k, v, attn_mask=mask, enable_gqa=True)
        ref = attention_ext.attention_reference(q, k, v, mask, enable_gqa=True)[0]
        assert (out.double() - ref).abs().max() < 2e-5


def test_attention_weights_checks_enable_gqa_is_a_bool():
    with pytest.raises(TypeError, match=r"enable_gqa must be a bool, got str"):
        attention_ext.attention_weights(t(2, 4, 3, 8), t(2, 2, 5, 8), enable_gqa="yes")


@pytest.mark.parametrize("name", ["scale", "dropout_p"])
def test_integers_too_large_for_a_float_raise_value_error(name):
    with pytest.raises(ValueError, match=rf"{name} must be .* too large for a float"):
        attention_ext.attention(t(2, 3, 4), t(2, 5, 4), t(2, 5, 3), **{name: 10 ** 400})


@pytest.mark.parametrize("dtype,scale", [(torch.float32, 1e39), (torch.float16, -1e39), (torch.bfloat16, 1e300)])
def test_scale_beyond_the_accumulation_dtype_raises_value_error(dtype, scale):
    """float32/float16/bfloat16 accumulate in float32: a scale that is infinite there would turn every
    score into inf or NaN (it returned zeros or NaN)."""
    q, k, v = t(2, 3, 4, dtype=dtype), t(2, 5, 4, dtype=dtype), t(2, 5, 3, dtype=dtype)
    with pytest.raises(ValueError, match=r"scale must be finite in the torch.float32 accumulation"):
        attention_ext.attention(q, k, v, scale=scale)
    with pytest.raises(ValueError, match=r"scale must be finite in the torch.float32 accumulation"):
        attention_ext.attention_weights(q, k, scale=scale)


def test_float64_accepts_a_huge_finite_scale_and_matches_the_reference():
    q, k, v = t(2, 3, 4, dtype=torch.float64), t(2, 5, 4, dtype=torch.float64), t(2, 5, 3, dtype=torch.float64)
    out = attention_ext.attention(q, k, v, scale=1e300)
    ref = attention_ext.attention_reference(q, k, v, scale=1e300)[0]
    assert torch.isfinite(ref).all() and (out - ref).abs().max() < 1e-12


# ----------------------------------------------------------------------------------------------
# Issues the fuzz run found in the raw ops (fixed; these keep them fixed).

def test_raw_ops_with_a_meta_tensor_validate_like_the_cpu_kernels():
    q, k, v = t(2, 3, 4), t(2, 5, 4), t(2, 5, 3)
    meta = torch.empty(2, 5, 4, device="meta")
    with pytest.raises(RuntimeError, match=r"same device"):
        ops.attention_fwd(q, meta, v, None, 1.0, 0, -1, -1, 0.0, None, None, 0.0, None)
    with pytest.raises(RuntimeError, match=r"same device"):
        ops.attention_probs(q, meta, None, 1.0, 0, -1, -1, 0.0, None, None)
    with pytest.raises(RuntimeError, match=r"causal must be"):
        ops.attention_fwd(q.to("meta"), k.to("meta"), v.to("meta"), None, 1.0, 7, -1, -1, 0.0, None, None, 0.0, None)
    with pytest.raises(RuntimeError, match=r"same head dim"):
        ops.attention_fwd(q.to("meta"), t(2, 5, 6).to("meta"), v.to("meta"), None, 1.0, 0, -1, -1, 0.0, None, None, 0.0, None)
    with pytest.raises(RuntimeError, match=r"at least 2 dims"):  # the fake kernel: IndexError
        ops.attention_fwd(t(72), k, v, None, 1.0, 0, -1, -1, 0.0, None, None, 0.3, torch.zeros(2, dtype=torch.int64, device="meta"))


def test_raw_attention_probs_with_a_0d_key_raises_instead_of_crashing():
    # In a subprocess, so that a regression (the empty value tensor made from key.sizes().back()
    # before the checks; fuzz seed 0, call 4419 of 12000) fails this test instead of killing pytest.
    code = ("import torch, attention_ext\n"
            "q, k = torch.randn(2, 5, 4), torch.ones(())\n"
            "try:\n"
            "    torch.ops.attention_ext.attention_probs(q, k, None, 0.5, 0, -1, -1, 0.0, None, None)\n"
            "except RuntimeError as e:\n"
            "    print('raised:', e)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env(),
                          timeout=300)
    assert proc.returncode == 0, f"the process died with status {proc.returncode}"
    assert "raised:" in proc.stdout and "key" in proc.stdout, proc.stdout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_raw_ops_reject_a_scale_that_overflows_the_accumulation_dtype(dtype):
    q, k, v = t(2, 3, 4, dtype=dtype), t(2, 5, 4, dtype=dtype), t(2, 5, 3, dtype=dtype)
    try:
        out, _ = ops.attention_fwd(q, k, v, None, 1e39, 0, -1, -1, 0.0, None, None, 0.0, None)
    except RuntimeError as e:
        assert "scale" in str(e)
        return
    # Returned instead of raising: then the answer must be the reference's.
    ref = attention_ext.attention_reference(q, k, v, scale=1e39)[0]
    assert torch.isfinite(out).all(), "NaN instead of the answer"
    assert (out.double() - ref).abs().max() < 5e-2, "zeros instead of the answer"
