"""The suite never reads the user's caches: a warm vLLM cache in
~/.cache/vllm once hid a package missing from the set-up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests import cache_isolation
from tests.conftest import CACHE_ROOT


def test_every_cache_variable_points_into_the_runs_own_directory():
    for variable in cache_isolation.CACHE_VARIABLES:
        path = Path(os.environ[variable]).resolve()
        assert path.is_relative_to(CACHE_ROOT), f"{variable}={path} is outside {CACHE_ROOT}"
        assert not path.is_relative_to(cache_isolation.USER_CACHE), \
            f"{variable}={path} is the user's cache"


def test_a_child_process_resolves_vllms_and_hugging_faces_caches_into_the_run():
    """What vLLM's model inspection (a subprocess) and transformers would read."""
    probe = ("import json, vllm.envs as e, huggingface_hub.constants as h; "
             "print(json.dumps([e.VLLM_CACHE_ROOT, h.HF_HOME]))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120, check=True)
    for path in json.loads(out.stdout.strip().splitlines()[-1]):
        assert Path(path).resolve().is_relative_to(CACHE_ROOT), path
