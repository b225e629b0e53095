"""The supervisor's children get their tokens over a pipe that only they read, and
the record the broker checks holds no token (a token is what admits a
worker or tier process; one readable in /proc/<pid>/environ, or in the record, is
one any process of the user could present)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.integration.cluster import make_config
from tierkv.node.children import FILE_NAME, ChildRegistry, child_by_token, verified_child
from tierkv.node.supervisor import Node


def test_tokens_reach_only_their_children_and_the_record_holds_digests(instance, tmp_path,
                                                                       monkeypatch):
    issued: list[str] = []
    new_token = ChildRegistry.new_token

    def recording() -> str:
        issued.append(new_token())
        return issued[-1]

    monkeypatch.setattr(ChildRegistry, "new_token", staticmethod(recording))
    config = make_config(instance, tmp_path / "run", worker={"device": "cpu"},
                         tiers=[{"type": "memory", "name": "mem", "capacity_blocks": 16}])
    with Node(config) as node:
        children = {name: child.pid for name, child in node.children.items()}
        # One per peer that says hello: the worker and the tier process, not the broker.
        assert len(issued) == 2 and set(children) == {"broker", "worker0", "tier:mem:0"}
        record_text = (config.run_path / FILE_NAME).read_text()
        exposed = b""
        for pid in children.values():
            proc = Path(f"/proc/{pid}")
            exposed += (proc / "environ").read_bytes() + (proc / "cmdline").read_bytes()
        for token in issued:
            assert token.encode() not in exposed
            assert token not in record_text
        # Each token names its own child, checked against the process running now.
        by_token = {child_by_token(config.run_path, t).name: t for t in issued}
        assert by_token.keys() == {"worker0", "tier:mem:0"}
        for name, token in by_token.items():
            assert verified_child(config.run_path, token, children[name], 0)
        assert child_by_token(config.run_path, "not-a-token") is None
        assert len(json.loads(record_text)) == 2
        # A restarted child gets a new token; the old one admits nothing any more.
        old = by_token["tier:mem:0"]
        node.kill("tier:mem:0")
        node.children["tier:mem:0"].proc.wait(10)
        node.spawn(next(s for s in node.specs() if s.name == "tier:mem:0"))
        assert child_by_token(config.run_path, old) is None
        assert child_by_token(config.run_path, issued[-1]).pid == node.pid("tier:mem:0")
