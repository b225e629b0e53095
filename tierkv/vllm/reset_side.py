"""The manager's reset and fence side: `reset_cache` starts a new generation of the
engine's namespace and fences what is still in flight (pins of loads, reservations
of stores) until vLLM says the workers are done with it (`on_reset_flushed`);
`shutdown` lets go of everything the engine holds; `held` counts it."""

from __future__ import annotations

from tierkv.vllm.layout import KeyMap
from tierkv.vllm.manager_state import ManagerState

SHUTDOWN_LOCK_S = 5.0  # a step that raised may have left the lock held on this thread


class ResetSide(ManagerState):
    """Reset, fences and shutdown (see the module docstring)."""

    def held(self) -> dict[str, int]:
        """What this engine holds at the node now, by its own account: rows its
        stores are writing, pins it has not released, the copies a cache reset left
        in flight (`on_reset_flushed`), and operations it still owes the broker."""
        holdings = self.holdings
        return {"writing": len(holdings.writing), "pins": sum(holdings.pins.values()),
                "fenced": len(self._fenced) + len(self._fenced_writes),
                "owed": int(bool(holdings.owed))}

    def reset_cache(self) -> None:
        """vLLM's prefix caches are reset (its weights change): a new generation of
        this engine's namespace, so nothing stored before is its hit again (other
        engines keep theirs). Pins it holds for answers go now; those of loads and the
        reservations of stores vLLM submitted go once the workers are done with them
        (`on_reset_flushed`)."""
        self.rounds.catch_up()
        for state in self._requests.values():  # keyed with this generation's keymap
            self._unpin(state, list(state.rows))
            state.answers.clear()
            state.covered = False
            state.asks.clear()
        self.generation += 1
        self.keymap = KeyMap(self.identity.namespace(self.generation))
        self.link.client.scope = self.keymap.prefix
        self._fenced.extend(k for loading in self._loading.values()
                            for k in loading.values())
        self._loading.clear()
        self._fenced_writes.extend(r.keys for r in self.holdings.writing.values())
        self.holdings.writing.clear()

    def on_reset_flushed(self) -> None:
        for keys in self._fenced:
            self.holdings.release(keys)
        for keys in self._fenced_writes:
            self.holdings.commit(keys, False)
        self._fenced, self._fenced_writes = [], []

    def shutdown(self) -> None:
        """Let go of everything at the broker, then close the connection (the broker
        ends this engine as its owner). Called without the lock; it takes it, unless a
        step that raised left it held, which must not hang the engine's exit."""
        locked = self._lock.acquire(timeout=SHUTDOWN_LOCK_S)
        try:
            self.rounds.catch_up()
            self.on_reset_flushed()
            for req_id in list(self._requests):
                self.on_request_finished(self._requests[req_id].ctx)
            for loading in self._loading.values():
                for keys in loading.values():
                    self.holdings.release(keys)
            self._loading.clear()
            self.holdings.let_go_of_everything()
            self.holdings.commit(self.spares.drop_all(), False)
        finally:
            try:
                self.rounds.finish(self.generation, self.link.client.timeout)
            finally:
                if locked:
                    self._lock.release()
