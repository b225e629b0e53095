"""Every cache a test run reads lives in a directory of its own, made for the run.

vLLM caches what it learns of a model's architecture under the user's cache
directory (`$XDG_CACHE_HOME/vllm`, `~/.cache/vllm`); a run on a machine where that
cache is warm skipped the subprocess that imports the model class, and so hid a
package missing from the set-up. Pointing every cache at a fresh
directory before anything imports vLLM, torch or transformers makes each run see
what a fresh machine sees. Child processes (vLLM's inspection, the node's
processes) inherit the environment, so they see the same.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

# The user's own cache directory, as it was before the run changed anything.
USER_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").resolve()

# Variable -> sub-directory of the run's cache root.
CACHE_VARIABLES = {
    "XDG_CACHE_HOME": "xdg",
    "VLLM_CACHE_ROOT": "vllm",
    "HF_HOME": "huggingface",
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "TRITON_CACHE_DIR": "triton",
    "NUMBA_CACHE_DIR": "numba",
    "MPLCONFIGDIR": "matplotlib",
}


def isolate() -> Path:
    """Point every cache variable at a new directory of this run; returns its root."""
    root = Path(tempfile.mkdtemp(prefix="tierkv-test-cache-")).resolve()
    for variable, sub in CACHE_VARIABLES.items():
        path = root / sub
        path.mkdir()
        os.environ[variable] = str(path)
    return root


def remove(root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)
