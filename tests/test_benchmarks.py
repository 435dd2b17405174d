"""The benchmark scripts run end to end (their numbers are measured elsewhere: benchmarks/README.md).
The GPU benchmark has a CPU dry run (tiny shapes, the backends torch has on the CPU) so that the
script a GPU session depends on is exercised on every machine."""
import json
import os
import subprocess
import sys

import pytest

import attention_ext

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def env_importing_this_attention_ext():
    """The benchmark imports whichever attention_ext Python finds: make it the one under test (a
    scratch copy's in-place build, say, rather than an installed one)."""
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(attention_ext.__file__)))
    path = [package_root] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path))


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
