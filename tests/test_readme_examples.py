"""The README's Python examples run as written, in order, in one namespace (later blocks use the
earlier blocks' imports). Two are run elsewhere: the torchrun one in test_context_parallel.py, and
the Hugging Face one needs a model download (tests/test_hf_integration.py builds models from
configs instead)."""
from __future__ import annotations

import os
import re

import pytest
import torch

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def python_blocks():
    with open(README, encoding="utf-8") as f:
        return re.findall(r"```python\n(.*?)```", f.read(), re.DOTALL)


def test_the_readme_has_the_examples_this_file_runs():
    blocks = python_blocks()
    assert len(blocks) >= 6
    assert sum("torchrun" in b or "from_pretrained" in b for b in blocks) == 2


@pytest.mark.slow_on_emulation
def test_the_readme_python_examples_run():
    namespace = {}
    torch.manual_seed(0)
    for block in python_blocks():
        if "torchrun" in block or "from_pretrained" in block:
            continue
        exec(compile(block, "README.md", "exec"), namespace)
    # The KV-cache example says where the new keys land.
    k, lengths, k_cache = namespace["k"], namespace["lengths"], namespace["k_cache"]
    for b, position in enumerate(lengths.tolist()):
        assert torch.equal(k_cache[b, position], k[b, 0])
