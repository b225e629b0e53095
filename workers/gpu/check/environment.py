"""What gpu-check says about the machine before it measures anything: the facts a
figure needs next to it (GPU, PCIe link, driver and runtime, libcudart in use,
/dev/shm, the locked-memory limit, the allocator settings)."""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
from collections.abc import Callable

Say = Callable[..., None]


def _limit(value: int) -> str:
    return "unlimited" if value == resource.RLIM_INFINITY else f"{value / 2**20:.0f} MiB"


def host(say: Say) -> None:
    import numpy as np
    import torch

    say(f"python {sys.version.split()[0]} ({sys.executable}), torch {torch.__version__} "
        f"(CUDA build {torch.version.cuda}), numpy {np.__version__}, {os.cpu_count()} CPUs")
    st = os.statvfs("/dev/shm")
    say(f"df /dev/shm: {st.f_blocks * st.f_frsize / 2**30:.1f} GiB, "
        f"{st.f_bavail * st.f_frsize / 2**30:.1f} GiB free")
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    say(f"ulimit -l: {_limit(soft)} (hard {_limit(hard)})")
    for key in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "CUDA_VISIBLE_DEVICES",
                "TIERKV_CUDA_DMA"):
        say(f"{key}={os.environ.get(key)!r}")


def _sysfs_link(bus_id: str) -> str:
    base = f"/sys/bus/pci/devices/{bus_id.lower()}"
    try:
        read = {n: open(f"{base}/{n}").read().strip() for n in (
            "current_link_speed", "current_link_width", "max_link_speed", "max_link_width")}
    except OSError:
        return ""
    return (f"PCIe {read['current_link_speed']} x{read['current_link_width']} (max "
            f"{read['max_link_speed']} x{read['max_link_width']}; an idle link may run slower)")


def _nvidia_smi() -> list[str]:
    if shutil.which("nvidia-smi") is None:
        return []
    query = ("index,name,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,"
             "pcie.link.width.max,driver_version,pci.bus_id")
    try:
        done = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in done.stdout.splitlines() if line.strip()]


def gpus(say: Say) -> None:
    import torch

    from workers.gpu.cudart import cuda_runtime, version_text

    runtime = cuda_runtime()
    if runtime is None:
        say("libcudart: none found in this process (DMA falls back to torch copies)")
    else:
        say(f"libcudart in use: {runtime.path}; runtime {version_text(runtime.version)}, "
            f"driver supports {version_text(runtime.driver_version)}; "
            f"cudaMemcpyBatchAsync: {runtime.has_batch}, cudaMemcpy2DAsync: {runtime.has_2d}")
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        bus = ""
        if hasattr(p, "pci_bus_id"):
            bus = (f"{getattr(p, 'pci_domain_id', 0):04x}:{p.pci_bus_id:02x}:"
                   f"{getattr(p, 'pci_device_id', 0):02x}.0")
        say(f"cuda:{i}: {p.name}, {p.total_memory / 2**30:.1f} GiB, {bus} "
            f"{_sysfs_link(bus) if bus else ''}")
    for line in _nvidia_smi():
        say(f"nvidia-smi: {line}  (index, name, PCIe gen cur/max, width cur/max, driver, bus)")
