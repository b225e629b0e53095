"""The gpu worker's copy engine: `transfer.TransferEngine` checks jobs (`jobs`) and
hands them to a backend per device kind (`copy_cpu`, `copy_cuda`). The process entry
point is `workers/gpu_worker.py`."""
