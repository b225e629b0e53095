"""The supervisor's probe of the broker: restarts follow exits, and a hung broker
does not exit, so only a probe that asks it something notices."""

from __future__ import annotations

import threading

from tierkv.node.config import Config


class BrokerProbe(threading.Thread):
    """Asks the broker for `stats` every `interval_s` on its own thread (a hung
    broker must not stall the watch loop). Restarts only follow exits, and a hung
    broker does not exit: clients would get `BrokerUnavailable` for as long as it
    hangs. A broker counts as hung once it has answered and then misses `misses`
    probes in a row; the pid that answered is reported, so a broker still starting
    (prefaulting a large region) or already replaced is never the one killed."""

    def __init__(self, config: Config, misses: int, interval_s: float) -> None:
        super().__init__(name="broker-probe", daemon=True)
        self.config = config
        self.misses = misses
        self.interval_s = interval_s
        self.hung_pid: int | None = None
        self._stop = threading.Event()

    def run(self) -> None:
        from tierkv.client import BrokerUnavailable, Client, RemoteError

        answered: int | None = None
        missed = 0
        address, curve = self.config.connect_address("client"), self.config.client.curve_keys()
        while not self._stop.wait(self.interval_s):
            try:
                with Client(address, timeout=self.interval_s, curve=curve) as client:
                    answered, missed = int(client.stats()["pid"]), 0
            except (BrokerUnavailable, RemoteError, OSError):
                missed += 1
                if answered is not None and missed >= self.misses:
                    self.hung_pid, answered, missed = answered, None, 0

    def stop(self) -> None:
        self._stop.set()
