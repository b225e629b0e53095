"""tierkv: a multi-tier KV-cache offloading service for LLM inference.

The package is organised by layer (docs/architecture.md): `core` (blocks, the CPU-tier
manager, tiering, policies), `tiers` (the tier interface and the in-process tiers),
`wire` (protocol and sockets), `engine` and `client` (the engine's side), `vllm` (the
vLLM adapter), `node` (config, supervisor, status), `workloads`, `demo` and `bench`.

Modules that lived at the top level before that layout keep their import names
(`tierkv.protocol`, `tierkv.primary`, `tierkv.workload`, ...): `_STABLE_NAMES` maps
each to where it lives now, and importing the old name returns the same module
object, so user code and pickles that name them keep working.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import CodeType, ModuleType
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from tierkv.client import Client

_STABLE_NAMES = {
    "tierkv.keys": "tierkv.core.keys",
    "tierkv.errors": "tierkv.core.errors",
    "tierkv.blockformat": "tierkv.core.blockformat",
    "tierkv.shm": "tierkv.core.shm",
    "tierkv.primary": "tierkv.core.primary",
    "tierkv.tiering": "tierkv.core.tiering",
    "tierkv.reuse": "tierkv.core.reuse",
    "tierkv.policies": "tierkv.core.policies",
    "tierkv.protocol": "tierkv.wire.protocol",
    "tierkv.sockets": "tierkv.wire.sockets",
    "tierkv.config": "tierkv.node.config",
    "tierkv.supervisor": "tierkv.node.supervisor",
    "tierkv.status": "tierkv.node.status",
    "tierkv.s3server": "tierkv.node.s3server",
    "tierkv.replay": "tierkv.bench.replay",
    "tierkv.belady": "tierkv.bench.belady",
    "tierkv.traces": "tierkv.workloads.traces",
    "tierkv.workload": "tierkv.workloads.synthetic",
}


def _target(fullname: str) -> str | None:
    for old, new in _STABLE_NAMES.items():
        if fullname == old or fullname.startswith(old + "."):
            return new + fullname[len(old):]
    return None


class _AliasLoader(importlib.abc.Loader):
    """Loads an old name as the module that lives under the new one."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:
        """Already executed under its own name."""

    def get_code(self, fullname: str) -> CodeType | None:
        """For `python -m tierkv.s3server` and friends (runpy asks for the code)."""
        spec = importlib.util.find_spec(self.target)
        loader = spec.loader if spec is not None else None
        return loader.get_code(self.target) if loader is not None else None  # type: ignore[attr-defined]


class _StableNames(importlib.abc.MetaPathFinder):
    """Runs before the path finder: `tierkv.policies.lru` would otherwise be found in
    the real package's folder and executed a second time under the old name."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None
                  ) -> importlib.machinery.ModuleSpec | None:
        new = _target(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, _AliasLoader(new))


if not any(isinstance(f, _StableNames) for f in sys.meta_path):
    sys.meta_path.insert(0, _StableNames())  # before PathFinder: see `find_spec`


def __getattr__(name: str) -> Any:
    """`from tierkv import Client` without importing zmq for every `import tierkv`."""
    if name == "Client":
        from tierkv.client import Client

        return Client
    raise AttributeError(f"module 'tierkv' has no attribute {name!r}")


__all__ = ["Client", "__version__"]
