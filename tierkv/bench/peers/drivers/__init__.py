"""The drivers: one process per system, speaking JSON lines on stdin/stdout.

`lmcache_driver` and `vllm_driver` run in the peers' environment with their
peer imported; `tierkv_driver` runs in tierkv's. `common` holds what all of them
share and imports only the standard library and numpy.
"""
