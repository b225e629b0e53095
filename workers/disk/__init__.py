"""The disk tier (`type = "disk"`): `backend.DiskBackend` over slab files of verified
slots (`slabs`), made durable once per job (`commit`), laid out by `layout`."""

from workers.disk.backend import DiskBackend
from workers.disk.layout import HEADER_AREA, namespace_dir, namespace_tag, slot_bytes_for

__all__ = ["HEADER_AREA", "DiskBackend", "namespace_dir", "namespace_tag", "slot_bytes_for"]
