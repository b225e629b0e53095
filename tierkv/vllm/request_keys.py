"""The one private part of vLLM 0.33 that tierkv reads: a request's record of keys.

vLLM's scheduler records every offload key it makes for a request, with its
end-token position, in `ReqContext` before any lookup, and offers only a getter per
key (`get_offload_key_position`). Knowing the keys a request has not asked about
yet lets tierkv look a request's chain up in one round trip (`lookups.chain_for`) and
tell a policy the request's whole chain (`policies`). There is no public way to
enumerate them, so this module reads the record, and `check_request_keys` is run
when tierkv starts inside vLLM: a vLLM without it stops there, naming its version,
rather than run on a guess.
"""

from __future__ import annotations

from collections.abc import Mapping

from vllm.v1.kv_offload.base import OffloadKey, ReqContext

RECORD = "_offload_key_positions"


def request_keys(ctx: ReqContext) -> Mapping[bytes, int]:
    """Every key vLLM made for the request, with its end-token position."""
    return getattr(ctx, RECORD)


def check_request_keys() -> str | None:
    """Why the record cannot be read in this vLLM (None: it can)."""
    ctx = ReqContext(req_id="tierkv-probe")
    try:
        record = getattr(ctx, RECORD)
    except AttributeError:
        record = None
    if not isinstance(record, dict):
        return f"ReqContext has no {RECORD} record"
    key = OffloadKey(b"\x00" * 8)
    ctx.set_offload_key_position(key, 16)
    if record.get(key) != 16:
        return f"ReqContext.set_offload_key_position does not fill {RECORD}"
    return None


def require_request_keys(what: str, remedy: str) -> None:
    """Stop now, naming vLLM's version, if `what` cannot read the record."""
    why = check_request_keys()
    if why is not None:
        import vllm

        raise RuntimeError(f"{what} cannot run on vLLM {vllm.__version__} ({why}; it was "
                           f"written for 0.33): {remedy}")
