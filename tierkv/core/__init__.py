"""The core every process shares: keys and errors, the block format, the shared
region, the CPU-tier block manager (`primary`), the tiering orchestrator, the
eviction policies and the reuse filter. No sockets, no processes, no torch."""
