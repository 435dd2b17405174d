"""tests/gpu_check.sh, the one short GPU run, checked without a GPU through its dry run
(GPU_CHECK_DRY_RUN=1: every stage on CPU tensors, no build, no compute-sanitizer unless one is named).

What a GPU session gets back from $OUT is at most 8 files of at most 16 MiB each, no deeper than two
folders, named with letters, digits, '.', '_' and '-' only; anything else is lost. So the script
must leave summary.txt and a few files there, report every stage, skip what its time budget cannot
fit (as skipped, not as a failure), and report failures with their evidence.

The three runs start together (each is mostly Python start-up and imports) and each test waits for
the one it reads.
"""
import json
import os
import re
import signal
import subprocess
import sys
import tarfile

import pytest

from conftest import CUDA_EMULATION

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "gpu_check.sh")
STAGES = ["build", "smoke", "test_cuda", "memcheck", "bench_gpu", "memcheck_splitkv", "racecheck",
          "synccheck"]
OPTIONAL = STAGES[2:]
KEPT_FILES = {"summary.txt", "build.log", "test_cuda.log", "results_gpu.md", "results_gpu.json",
              "logs.tar.gz"}
NAME = re.compile(r"^[A-Za-z0-9._-]+$")

# Stands in for compute-sanitizer: memcheck finds an error, the other tools cannot use the device.
FAKE_SANITIZER = """#!/usr/bin/env bash
case " $* " in
  *" --tool memcheck "*)
    echo "========= COMPUTE-SANITIZER"
    echo "========= Invalid __global__ write of size 4 bytes"
    echo "=========     at combine_kernel+0x1f0"
    echo "========= ERROR SUMMARY: 1 error"
    exit 1 ;;
  *)
    echo "========= COMPUTE-SANITIZER"
    echo "========= Error: Device not supported"
    exit 255 ;;
esac
"""


class Run:
    def __init__(self, out, log, proc):
        self.out, self.log, self.proc = out, log, proc
        self._done = None

    def result(self):
        """(exit status, stdout+stderr, summary.txt, [(stage, status)] in summary order)"""
        if self._done is None:
            rc = self.proc.wait(timeout=900)
            stdout = open(self.log).read()
            summary_path = os.path.join(self.out, "summary.txt")
            summary = open(summary_path).read() if os.path.exists(summary_path) else ""
            stages = re.findall(r"^stage (\w+): (.*)$", summary, re.M)
            self._done = rc, stdout, summary, stages
        return self._done


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("gpu_check")
    fake = base / "compute-sanitizer"
    fake.write_text(FAKE_SANITIZER)
    fake.chmod(0o755)
    faulty_out = base / "faulty"
    # Left in $OUT before the run: more files than come back, a bad name, a file 3 folders down.
    (faulty_out / "a" / "b" / "c").mkdir(parents=True)
    (faulty_out / "a" / "b" / "c" / "deep.txt").write_text("x")
    (faulty_out / "stale 1.txt").write_text("x")
    for i in range(5):
        (faulty_out / f"stale{i}.txt").write_text("x")
    # The full run with a budget no stage hits: it checks the script, not how fast this machine
    # (under the sanitizer, beside another pytest worker) gets through 450 s of GPU plan.
    cases = {} if CUDA_EMULATION else {"full": {"GPU_CHECK_BUDGET": "3600"}}  # emulated kernels: minutes (see FULL_RUN)
    cases["tiny_budget"] = {"GPU_CHECK_BUDGET": "1"}
    cases["faulty"] = {"GPU_CHECK_SANITIZER": str(fake), "GPU_CHECK_STEPS": "memcheck,racecheck synccheck"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")}
    # Three runs share the cores: one OpenMP thread each instead of all of them spinning on every core.
    env.update(GPU_CHECK_DRY_RUN="1", PYTHON=sys.executable, OMP_NUM_THREADS="1")
    started = {}
    for name, extra in cases.items():
        out = base / name
        out.mkdir(exist_ok=True)
        log = base / f"{name}.stdout"
        with open(log, "w") as f:
            proc = subprocess.Popen(["bash", SCRIPT], stdout=f, stderr=subprocess.STDOUT,
                                    env=dict(env, OUT=str(out), **extra), start_new_session=True)
        started[name] = Run(str(out), str(log), proc)
    yield started
    for run in started.values():  # a run still going (a test failed early): its whole process group
        if run.proc.poll() is None:
            os.killpg(run.proc.pid, signal.SIGKILL)
            run.proc.wait()


def out_problems(out):
    """What would not come back from $OUT whole, by the device run's rules."""
    problems, files = [], 0
    for dirpath, dirnames, filenames in os.walk(out):
        rel_dir = os.path.relpath(dirpath, out)
        depth = 0 if rel_dir == "." else rel_dir.count(os.sep) + 1
        for name in dirnames + filenames:
            if not NAME.match(name):
                problems.append(f"bad name {name!r}")
        for name in filenames:
            path = os.path.join(dirpath, name)
            files += 1
            if depth > 2:
                problems.append(f"{path} is {depth} folders down")
            if os.path.islink(path) or not os.path.isfile(path):
                problems.append(f"{path} is not a plain file")
            elif os.path.getsize(path) > 16 * 2**20:
                problems.append(f"{path} is over 16 MiB")
    if files > 8:
        problems.append(f"{files} files")
    if not os.path.isfile(os.path.join(out, "summary.txt")):
        problems.append("no summary.txt")
    return problems


# The whole dry run runs the sanitizer snippets, whose tensor-core calls take minutes on the emulated
# kernels; there, the two short runs below still check the script.
FULL_RUN = pytest.mark.slow_on_emulation


@FULL_RUN
def test_dry_run_reports_every_stage_ok_or_skipped_for_time(runs):
    rc, stdout, summary, stages = runs["full"].result()
    assert rc == 0, stdout[-4000:]
    assert [name for name, _ in stages] == STAGES, summary
    for name, status in stages:
        assert status.startswith(("ok", "skipped: no time")), (name, status, stdout[-4000:])
    assert re.search(r"^result: 0 failed", summary, re.M), summary
    assert re.search(r"^commit: .+; csrc tree: .+", summary, re.M), summary


@FULL_RUN
def test_dry_run_output_fits_what_a_device_run_returns(runs):
    rc, stdout, summary, stages = runs["full"].result()
    out = runs["full"].out
    assert out_problems(out) == []
    assert set(os.listdir(out)) == KEPT_FILES, "every stage ran, so every kept file is there"
    assert re.search(r"^out: 6 files, .*fits what a device run returns$", summary, re.M), summary
    with tarfile.open(os.path.join(out, "logs.tar.gz")) as tar:
        logs = {os.path.normpath(m.name) for m in tar.getmembers() if m.isfile()}
    assert logs == {"env.log", "smoke.log", "bench_gpu.log", "memcheck.log", "memcheck_splitkv.log",
                    "racecheck.log", "synccheck.log"}


@FULL_RUN
def test_dry_run_benchmark_puts_tensor_core_rows_first_and_records_the_sources(runs):
    runs["full"].result()
    result = json.loads(open(os.path.join(runs["full"].out, "results_gpu.json")).read())
    # The dry run asks for "float32,float16": the tensor-core dtype still runs first.
    dtypes = [r["dtype"] for r in result["rows"]]
    assert set(dtypes) == {"float16", "float32"}
    assert dtypes == sorted(dtypes, key=lambda d: d != "float16"), dtypes
    assert result["meta"]["status"] == "complete"
    assert len(result["rows"]) == result["meta"]["rows_planned"]
    sources = result["meta"]["sources"]
    assert set(sources) == {"commit", "csrc_tree", "csrc_uncommitted_changes", "csrc_digest",
                            "build_csrc_digest"}
    assert sources["csrc_digest"] and len(sources["csrc_digest"]) == 64


def test_steps_the_budget_cannot_fit_are_skipped_not_failed(runs):
    rc, stdout, summary, stages = runs["tiny_budget"].result()
    assert rc == 0, stdout[-4000:]
    status = dict(stages)
    assert list(status) == STAGES, summary
    assert status["build"].startswith("ok") and status["smoke"].startswith("ok"), "run whatever the budget"
    for name in OPTIONAL:
        assert status[name].startswith("skipped: no time"), (name, status[name])
    assert re.search(r"^result: 0 failed, 0 incomplete, 6 skipped", summary, re.M), summary
    assert out_problems(runs["tiny_budget"].out) == []


def test_a_sanitizer_report_fails_its_step_and_is_printed(runs):
    rc, stdout, summary, stages = runs["faulty"].result()
    assert rc == 1
    status = dict(stages)
    assert status["memcheck"].startswith("FAIL"), status
    for text in (stdout, summary):  # the evidence where a GPU session sees it first, and in the file
        assert "Invalid __global__ write of size 4 bytes" in text and "at combine_kernel" in text


def test_a_device_the_sanitizer_does_not_support_skips_the_sanitizers(runs):
    rc, stdout, summary, stages = runs["faulty"].result()
    status = dict(stages)
    assert list(status) == STAGES, summary
    unsupported = "skipped: compute-sanitizer reports: device not supported"
    assert status["racecheck"] == status["synccheck"] == unsupported
    for name in ("test_cuda", "bench_gpu", "memcheck_splitkv"):
        assert status[name] == "skipped: not selected (GPU_CHECK_STEPS)"


def test_out_that_would_not_come_back_whole_fails_the_check(runs):
    rc, stdout, summary, stages = runs["faulty"].result()
    line = re.search(r"^out: PROBLEM:(.*)$", summary, re.M)
    assert line, summary
    for problem in ("'stale 1.txt': name", "'a/b/c': folder too deep", "'a/b/c/deep.txt': too deep",
                    "10 files > 8"):
        assert problem in line.group(1), line.group(1)
