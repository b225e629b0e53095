"""What makes two SGLang engines' pages interchangeable, and the keys it gives.

SGLang's page keys are chained hashes of the tokens alone (64 hex digits): they
carry no model, no rank and no byte layout, so two engines of different models
would name different bytes with the same key. Every tierkv key of this backend is
the key behind a namespace of the facts that decide a page's bytes:

* the model (SGLang's `model_name`, tagged with the host pool's page format when it
  has one), or the user's `namespace` standing in for it;
* the parallel layout: PP size and rank, attention context-parallel size and rank,
  decode context-parallel size and rank; and TP size and rank unless the model is
  MLA (its KV is whole on every rank of any TP size: one rank writes, all read);
* the host pool's byte layout: its class, memory layout (`layer_first`,
  `page_first`...), dtype, tokens per page, layers, heads and head sizes, and the
  sizes of the pieces a page is made of;
* SGLang's minor version (its hashes and layouts are its own).

The data-parallel rank is left out on purpose: DP replicas of one layout write the
same bytes for the same tokens, and sharing them is the point of a node-wide L3.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from tierkv.core.keys import MAX_KEY_LEN

NAMESPACE_BYTES = 8
PAGE_KEY_BYTES = 32
HEX_KEY_LEN = 2 * PAGE_KEY_BYTES
# The geometry attributes a host pool may have (MHA: heads; MLA: lora and rope dims).
POOL_FACTS = ("layout", "dtype", "page_size", "layer_num", "head_num", "head_dim",
              "v_head_dim", "kv_lora_rank", "qk_rope_head_dim", "kv_cache_dim")


@dataclass(frozen=True, slots=True)
class StorageIdentity:
    """Every fact that decides a page's bytes (see the module docstring)."""

    model: str
    parallel: tuple[int, ...]  # tp size and rank (-1 for MLA), pp, cp, dcp sizes, ranks
    mla: bool
    pool: tuple[str, ...]
    piece_sizes: tuple[int, ...]
    sglang_version: str

    @classmethod
    def of(cls, config: Any, host_pool: Any, piece_sizes: tuple[int, ...],
           explicit: str = "") -> StorageIdentity:
        """From SGLang's `HiCacheStorageConfig` and its registered host pool."""
        import sglang

        mla = bool(config.is_mla_model)
        # MLA's latent KV is whole on every TP rank, whatever the TP size.
        parallel = (-1 if mla else config.tp_size, -1 if mla else config.tp_rank,
                    config.pp_size,
                    config.pp_rank, config.attn_cp_size, config.attn_cp_rank,
                    getattr(config, "dcp_size", 1), getattr(config, "dcp_rank", 0))
        pool = (type(host_pool).__name__,
                *(f"{name}={getattr(host_pool, name, None)}" for name in POOL_FACTS))
        model = f"explicit:{explicit}" if explicit else str(config.model_name or "")
        return cls(model=model, parallel=tuple(int(p) for p in parallel), mla=mla,
                   pool=pool, piece_sizes=piece_sizes,
                   sglang_version=".".join(sglang.__version__.split(".")[:2]))

    def namespace(self, generation: int = 0, flat: bool = False) -> bytes:
        """The key prefix of this engine's pages after `generation` clears; `flat`:
        of the non-v1 path's flat page tensors, whose byte order is SGLang's
        `get_data_page` and not the pieces' order."""
        text = "\x1f".join(map(str, (self.model, self.parallel, self.mla, self.pool,
                                     self.piece_sizes, self.sglang_version, generation,
                                     "flat" if flat else "pages")))
        return hashlib.blake2b(text.encode(), digest_size=NAMESPACE_BYTES).digest()


@dataclass(frozen=True, slots=True)
class PageKeys:
    """SGLang page keys <-> tierkv keys under one namespace."""

    prefix: bytes

    def key(self, page_key: str) -> bytes:
        """A 64-hex SGLang hash as its 32 bytes; any other string (a non-v1 caller's
        own keys) by a 32-byte hash of it, so every key fits tierkv's 64 bytes."""
        if not isinstance(page_key, str) or not page_key:
            raise TypeError(f"an SGLang page key must be a non-empty str, got {page_key!r}")
        raw = _hex_bytes(page_key)
        if raw is None:
            raw = hashlib.blake2b(page_key.encode(), digest_size=PAGE_KEY_BYTES).digest()
        key = self.prefix + raw
        assert len(key) <= MAX_KEY_LEN
        return key

    def keys(self, page_keys: list[str]) -> list[bytes]:
        return [self.key(k) for k in page_keys]


def _hex_bytes(text: str) -> bytes | None:
    if len(text) != HEX_KEY_LEN:
        return None
    try:
        return bytes.fromhex(text)
    except ValueError:
        return None
