"""``scripts/gpu-check``: the transfer engine's device check (`__main__` runs the
parts) and its offline install step (`offline`, standard library only)."""
