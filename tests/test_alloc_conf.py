"""The CUDA allocator is configured against fragmentation before torch starts, unless the user chose."""
from __future__ import annotations

import os
import subprocess
import sys

CHECK = "import app.main, os; print(os.environ['PYTORCH_CUDA_ALLOC_CONF'])"


def _conf(env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_expandable_segments_by_default_and_the_users_value_kept():
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    assert _conf(env) == "expandable_segments:True"
    assert _conf({**env, "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}) == "max_split_size_mb:512"
