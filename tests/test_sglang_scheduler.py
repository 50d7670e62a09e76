"""kvtransport's SGLang backend driven by SGLang 0.5.23's own scheduler code, on CPU: each prefill
and decode rank is a process (tests/sglang_scheduler.py) running SGLang's real queues
(``PrefillBootstrapQueue``, ``process_disagg_prefill_inflight_queue``, ``send_kv_chunk``;
``DecodePreallocQueue``/``DecodeTransferQueue`` through ``process_decode_queue``), SGLang's real
memory pools, allocators, ``Req`` objects, ``MetadataBuffers`` and its abort path
(``Scheduler.abort_request``), with gloo process groups among the ranks of a side so every poll is
SGLang's MIN all-reduce. The only stand-ins are the model forward (it writes deterministic KV),
the tokenizer/detokenizer IPC and the CUDA-only pieces; see the worker's docstring.

Every byte of every request's KV (each layer's K and V, or MLA's latent) and its aux row is checked
on the decode side against content both sides compute from the prompt's tokens, and both sides
must hand every page, request row and metadata slot back. Models with state buffers, built with
SGLang's own pools: a hybrid sliding-window model (tiny gpt-oss: ``SWAKVPool``; the window SGLang's
``_swa_payload`` names moves into decode's SWA tail pages) and a hybrid linear-attention model
(tiny Qwen3-Next: ``HybridLinearKVPool`` over a ``MambaPool``; the request's mamba slot moves in
every state tensor), each byte checked, and every SWA page and mamba slot handed back too.

With decode's radix cache (``--disaggregation-decode-enable-radix-cache``, SGLang's enabled
``UnifiedRadixCache`` on decode) a request that finished leaves its prompt in decode's tree, and a
later request that starts with the same tokens gets those pages from it: decode announces
``decode_prefix_len``, prefill sends only what follows (checked with the backend's transfer
metric), and decode checks every byte of the whole prompt, the cached prefix included; what the
tree keeps unlocked is not a leak, anything else is.

Prefill and decode may run different attention-TP sizes (each side's topology is its own; the
content names the global KV head, so it does not depend on how a side shards the heads): prefill
TP 2 into decode TP 1 (the decode rank gets one head from each prefill rank, MLA's replicated
latent from one of them), and prefill DP attention (attention TP 1 a DP rank) into decode TP 2
(the room's one prefill rank feeds both decode ranks, each its own head). There the checks
also ask that prefill's transfer metric, summed over a request's prefill ranks, is what its
decode ranks hold (each byte sent once), that the receiver lists every source it announced to
(what SGLang's deferred release waits for), and that aborts from either side fail every rank of
both.

One cluster of processes per pair of topologies (TP 1, TP 2, DP attention 2 on both sides; the
two unequal pairs) serves all the cases of that pair: a case reconfigures the instances (page
size, MLA, driver, timeouts) without a new process. The driver is ``KVTRANSPORT_DRIVER``
(nixl-ucx by default); the base case runs over nixl-ucx and mooncake-gdr (and mooncake-staged)
whatever it says.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import queue
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from .conftest import require_engines, unused_port

pytest.importorskip("sglang.srt.plugins", reason="needs sglang==0.5.23 (bash scripts/dev setup)")
pytest.importorskip("transformers", reason="needs SGLang's import-time dependencies (tests/requirements-sglang.txt)")

ROOT = Path(__file__).resolve().parent.parent
STAND_INS = Path(__file__).resolve().parent / "stand_ins"
CHILD_PATH = [ROOT, ROOT / "drivers" / "nixl", ROOT / "drivers" / "mooncake", ROOT / "drivers" / "cuda", STAND_INS]
#: Read at import: tests/conftest.py clears KVTRANSPORT_* around every test.
DRIVER = os.environ.get("KVTRANSPORT_DRIVER", "nixl-ucx")
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
}
#: Hybrid sliding-window attention (gpt-oss: every other layer slides; SGLang's window is
#: ``sliding_window - 1`` tokens, GptOssForCausalLM.get_attention_sliding_window_size).
TINY_GPT_OSS = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_hidden_layers": 4,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    "sliding_window": 49,
    "num_local_experts": 2,
    "num_experts_per_tok": 1,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
}
#: Hybrid linear attention (Qwen3-Next: gated delta-net layers with mamba state, every second
#: layer full attention).
TINY_QWEN3_NEXT = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_hidden_layers": 4,
    "full_attention_interval": 2,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "num_experts": 2,
    "num_experts_per_tok": 1,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "float32",
}
MODELS = {"llama": TINY_LLAMA, "swa": TINY_GPT_OSS, "mamba": TINY_QWEN3_NEXT}
FAST = {"KVTRANSPORT_HEARTBEAT_INTERVAL": "0.2", "KVTRANSPORT_HEARTBEAT_TIMEOUT": "3"}  # 2-core CI: 4 busy ranks
#: Timeouts for the abort cases: a failure that only the timers catch shows as a late one.
ABORT_TIMEOUT_S = 12
PROMPT_S = 6.0
ABORT_ENV = {
    "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": str(2 * PROMPT_S),
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": str(ABORT_TIMEOUT_S),
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": str(ABORT_TIMEOUT_S),
    "KVTRANSPORT_TRANSFER_TIMEOUT": str(ABORT_TIMEOUT_S),
}
STEP_S = 3.0  # the slowest scheduler iteration allowed (SGLang's loop must never wait on the network)
START_S = 240  # processes import SGLang (~12 s each) on two shared cores
NOISE = re.compile(r"UserWarning|warnings\.warn\(|^[IW]\d{4} |Radix cache is disabled|Intel AMX|deprecated")


class Rank:
    """One rank process; every exchange has a timeout; its stderr goes to a file."""

    def __init__(self, role: str, rank: int, args: list[str], env: dict[str, str], logdir: Path) -> None:
        self.name = f"{role}{rank}"
        self.role, self.rank = role, rank
        self.log = logdir / f"{self.name}.stderr"
        self._err = open(self.log, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.sglang_scheduler", "--role", role, "--rank", str(rank), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            text=True,
            cwd=ROOT,
            env=env,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.info: dict[str, Any] = {}

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def send(self, doc: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(doc) + "\n")
        self.proc.stdin.flush()

    def recv(self, deadline: float, seq: int | None = None) -> dict[str, Any]:
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"{self.name} gave no answer in time") from None
            if line is None:
                raise RuntimeError(f"{self.name} exited with {self.proc.poll()}")
            if line.startswith("{"):
                doc: dict[str, Any] = json.loads(line)
                if seq is not None and doc.get("seq") != seq:
                    continue  # the late answer to a command that timed out
                if "error" in doc:
                    raise RuntimeError(f"{self.name}: {doc['error']}\n{doc.get('traceback', '')}")
                return doc

    def stderr_tail(self, lines: int = 40) -> str:
        """The end of the rank's stderr, without import warnings and Mooncake's info lines."""
        if not self._err.closed:
            self._err.flush()
        text = self.log.read_text(errors="replace").splitlines()
        kept = [line for line in text if not NOISE.search(line)]
        return "\n".join(kept[-lines:])

    def ask_to_close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                self.send({"cmd": "close"})

    def close(self) -> None:
        self.ask_to_close()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._err.close()


@dataclass
class Outcome:
    prefill: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # rid -> one per rank
    decode: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    leaks: dict[str, dict[str, int]] = field(default_factory=dict)  # rank -> counts
    longest_step_s: dict[str, float] = field(default_factory=dict)  # rank -> its slowest scheduler iteration
    #: decode rank -> (count, first few) of pages written that no delivered request was given
    stray_pages: dict[str, tuple[int, list[int]]] = field(default_factory=dict)
    #: decode rank -> state pool ("swa_pages", "mamba_slots") -> the same, for state pools
    stray_state: dict[str, dict[str, tuple[int, list[int]]]] = field(default_factory=dict)
    #: decode rank -> tokens its radix tree holds after the run (with decode_radix_cache)
    tree_tokens: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    killed_at: float = 0.0  # when the prefill processes were killed (wall clock)


@dataclass(frozen=True)
class Topo:
    """One instance's parallelism, as its launcher gets it: ``--tp-size``, ``--dp-size`` and
    ``--enable-dp-attention``."""

    tp: int = 1
    dp: int = 1
    dp_attention: bool = False

    @property
    def attn_tp(self) -> int:
        """The ranks of one attention-TP group: those that serve one request."""
        return self.tp // self.dp if self.dp_attention else self.tp

    @property
    def attn_dp(self) -> int:
        """The attention-DP groups (DP ranks a request is routed among)."""
        return self.dp if self.dp_attention else 1

    def args(self) -> list[str]:
        flags = ["--dp-attention"] if self.dp_attention else []
        return ["--tp-size", str(self.tp), "--dp-size", str(self.dp), *flags]


class Cluster:
    """A prefill instance and a decode instance, one process per rank; each side its own
    topology (``decode`` defaults to ``prefill``'s)."""

    def __init__(self, tmp: Path, prefill: Topo, decode: Topo | None = None, env: dict[str, str] | None = None) -> None:
        self.topo = {"prefill": prefill, "decode": decode or prefill}
        self.env = dict(env or {})  # the ranks' KVTRANSPORT_* settings (the plugin reads them at start)
        self.tmp = tmp
        self.models: dict[str, Path] = {}
        for name, config in MODELS.items():
            self.models[name] = tmp / f"tiny-{name}"
            self.models[name].mkdir(parents=True, exist_ok=True)
            (self.models[name] / "config.json").write_text(json.dumps(config))
        self.model = self.models["llama"]
        self.ranks: list[Rank] = []
        self.config: dict[str, Any] | None = None
        self.page_size = 16
        self.rooms = itertools.count(1_000 + random.randrange(10**6) * 100)
        self.seq = itertools.count()
        self.spawns = 0
        self._spawn()

    def _spawn(self) -> None:
        self.close()
        self.spawns += 1
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("KVTRANSPORT_", "SGLANG_"))}
        path = os.pathsep.join([*(str(p) for p in CHILD_PATH), clean.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env = {**clean, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **self.env}
        logs = self.tmp / f"spawn{self.spawns}"
        logs.mkdir()
        self.ranks = []
        for role, topo in self.topo.items():
            args = [*topo.args(), "--master-port", str(unused_port()), "--model-path", str(self.model)]
            self.ranks += [Rank(role, r, args, env, logs) for r in range(topo.tp)]
        self.config = None
        with self.explain():
            deadline = time.monotonic() + START_S
            for r in self.ranks:
                r.recv(deadline)

    @property
    def prefill(self) -> list[Rank]:
        return [r for r in self.ranks if r.role == "prefill"]

    @property
    def decode(self) -> list[Rank]:
        return [r for r in self.ranks if r.role == "decode"]

    def room(self) -> int:
        return next(self.rooms)

    @property
    def sources(self) -> int:
        """How many prefill ranks feed each decode rank (within the prefill DP rank a request
        goes to): SGLang's target ranks, one when decode's attention TP is as wide or wider,
        prefill's attention TP over decode's when prefill's is wider."""
        p, d = self.topo["prefill"].attn_tp, self.topo["decode"].attn_tp
        return p // d if p > d else 1

    def configure(
        self,
        *,
        page_size: int = 16,
        mla: bool = False,
        model: str = "llama",
        driver: str = DRIVER,
        pool_tokens: int = 16384,
        registry_delay: float = 0,
        decode_radix_cache: bool = False,
        disable_overlap_schedule: bool = False,
        layer_compute_s: float = 0,
        direct_kv_writes: bool = False,
        max_context: int = 512,
        **env: str,
    ) -> None:
        """``model``: "llama" (MHA, or MLA with ``mla``), "swa" (hybrid sliding-window
        attention) or "mamba" (hybrid linear attention). ``decode_radix_cache``: the decode
        instance runs with ``--disaggregation-decode-enable-radix-cache``;
        ``disable_overlap_schedule``: both with ``--disable-overlap-schedule``;
        ``layer_compute_s``: the prefill forward's compute time per layer (after each layer's
        KV write); ``direct_kv_writes``: the forward writes the KV buffers itself, not through
        the pools' set_kv_buffer (as an FP4 pool or a CUDA graph replay); ``max_context``: the
        tokens of a request row (SGLang's ReqToTokenPool). The other keywords
        are environment variables of every rank."""
        want = {
            "page_size": page_size,
            "mla": mla,
            "model_path": str(self.models[model]),
            "pool_tokens": pool_tokens,
            "registry_delay": registry_delay,
            "decode_radix_cache": decode_radix_cache,
            "disable_overlap_schedule": disable_overlap_schedule,
            "layer_compute_s": layer_compute_s,
            "direct_kv_writes": direct_kv_writes,
            "max_context": max_context,
            "env": {"KVTRANSPORT_DRIVER": driver, **FAST, **env},
        }
        if any(r.proc.poll() is not None for r in self.ranks):
            self._spawn()  # a rank died (or was stopped after a broken exchange): start afresh
        if self.config == want:
            return
        self.config = None
        cfg = {**want, "bootstrap_port": unused_port()}
        seq = next(self.seq)
        with self.explain():
            for r in self.ranks:
                r.send({"cmd": "configure", "config": cfg, "seq": seq})
            deadline = time.monotonic() + 120
            for r in self.ranks:
                r.info = r.recv(deadline, seq)["info"]
        self.config = want
        self.page_size = page_size
        self.bootstrap_port = cfg["bootstrap_port"]

    def run(self, requests: list[dict[str, Any]], timeout: float = 60, kill_prefill_after: float = 0) -> Outcome:
        """Send every request to both instances: prefill DP rank ``room % dp`` (SGLang's
        follow_bootstrap_room), decode DP rank ``decode_dp`` (the router's choice; round robin
        unless the request says), every TP rank of that DP group. ``kill_prefill_after``: the
        prefill processes are killed that many seconds in (and every process restarts for the
        next case)."""
        assert self.config is not None, "configure first"
        prefill_dp, decode_dp = self.topo["prefill"].attn_dp, self.topo["decode"].attn_dp
        for i, req in enumerate(requests):
            req.setdefault("decode_dp", i % decode_dp)
            req["bootstrap_port"] = self.bootstrap_port
        decoded = [q for q in requests if not q.get("prefill_only")]
        t0 = time.monotonic()
        seq = next(self.seq)
        for r in self.ranks:
            if r.role == "prefill":
                mine = [q for q in requests if q.get("prefill_dp", q["room"]) % prefill_dp == r.info["attn_dp_rank"]]
            else:
                mine = [q for q in decoded if q["decode_dp"] % decode_dp == r.info["attn_dp_rank"]]
            r.send({"cmd": "run", "requests": mine, "timeout": timeout, "seq": seq})
        deadline = time.monotonic() + timeout + 60
        out = Outcome()
        if kill_prefill_after:
            time.sleep(kill_prefill_after)
            for r in self.prefill:
                r.proc.kill()
            out.killed_at = time.time()
        with self.explain():
            for r in self.ranks:
                if kill_prefill_after and r.role == "prefill":
                    continue
                answer = r.recv(deadline, seq)
                side = out.prefill if r.role == "prefill" else out.decode
                for rid, o in answer["outcomes"].items():
                    side.setdefault(rid, []).append({"rank": r.name, **o})
                out.leaks[r.name] = answer["leaks"]
                out.longest_step_s[r.name] = answer["longest_step_s"]
                if r.role == "decode":
                    out.stray_pages[r.name] = (answer["stray_page_count"], answer["stray_pages"])
                    out.stray_state[r.name] = {k: tuple(v) for k, v in answer["stray_state"].items()}
                    out.tree_tokens[r.name] = answer["tree_tokens"]
        out.wall_s = time.monotonic() - t0
        if kill_prefill_after:
            self.stop()  # the next configure starts every rank afresh
        clean = all(o["state"] != "timeout" for side in (out.prefill, out.decode) for v in side.values() for o in v)
        if not clean or any(any(c.values()) for c in out.leaks.values()):
            self.config = None  # requests left in SGLang's queues: the next case gets fresh instances
        return out

    @contextlib.contextmanager
    def explain(self) -> Iterator[None]:
        """A failure shows the ranks' stderr."""
        try:
            yield
        except BaseException as exc:
            if not isinstance(exc, AssertionError):
                self.stop()  # an exchange broke: the next configure starts new processes
            logs = "\n".join(f"----- {r.name} stderr -----\n{r.stderr_tail()}" for r in self.ranks)
            raise AssertionError(f"{type(exc).__name__}: {exc}\n{logs}") from exc

    def stop(self) -> None:
        for r in self.ranks:
            if r.proc.poll() is None:
                r.proc.kill()

    def close(self) -> None:
        for r in self.ranks:
            r.ask_to_close()  # all at once: each side tears down together
        for r in self.ranks:
            r.close()


def spawn(name: str, prefill: Topo, decode: Topo | None = None, env: dict[str, str] | None = None) -> Iterator[Cluster]:
    require_engines()
    with tempfile.TemporaryDirectory(prefix=f"sglang-{name}-") as tmp:
        cluster = Cluster(Path(tmp), prefill, decode, env)
        try:
            yield cluster
        finally:
            cluster.close()


@pytest.fixture(scope="module")
def tp1() -> Iterator[Cluster]:
    yield from spawn("tp1", Topo(tp=1))


@pytest.fixture(scope="module")
def tp2() -> Iterator[Cluster]:
    yield from spawn("tp2", Topo(tp=2))


@pytest.fixture(scope="module")
def dpa2() -> Iterator[Cluster]:
    yield from spawn("dpa2", Topo(tp=2, dp=2, dp_attention=True))


@pytest.fixture(scope="module")
def p2d1() -> Iterator[Cluster]:
    """Prefill TP 2, decode TP 1: the decode rank gets its two KV heads from two prefill ranks."""
    yield from spawn("p2d1", Topo(tp=2), Topo(tp=1))


@pytest.fixture(scope="module")
def dpa2d2() -> Iterator[Cluster]:
    """Prefill tp 2, dp 2 with DP attention (attention TP 1: each DP rank one rank holding both KV
    heads), decode TP 2 (attention TP 2, one head a rank): prefill's narrower attention TP,
    DP attention included; each prefill DP rank feeds both decode ranks. (Prefill TP 1 into
    decode TP 2 is what each of its DP ranks does: no cluster of its own, for CI's time.)"""
    yield from spawn("dpa2d2", Topo(tp=2, dp=2, dp_attention=True), Topo(tp=2))


# ---------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------


def kv_bytes(tokens: int, decode_rank: Rank, mla: bool = False) -> int:
    """Bytes of one request's KV on one decode rank: every layer's K and V of the rank's heads
    (or MLA's latent), in the dtype SGLang resolved for the model."""
    info = decode_rank.info
    per_token = (32 + 8) if mla else 2 * info["kv_heads"] * 16
    return tokens * info["layers"] * per_token * info["element_size"]


def state_bytes(tokens: int, decode_rank: Rank, page_size: int) -> int:
    """Bytes of one request's state on one decode rank: the SWA window SGLang transfers (the
    sliding-window layers' K and V of the last ``sliding_window_size`` tokens, from a page
    boundary) and the request's mamba slot in every state tensor."""
    info = decode_rank.info
    window = 0
    if info["swa_layers"]:
        start = max(0, tokens - int(info["sliding_window_size"])) // page_size * page_size
        window = (tokens - start) * int(info["swa_layers"]) * 2 * int(info["kv_heads"]) * 16 * int(info["element_size"])
    return window + int(info["mamba_row_bytes"])


def assert_all_delivered(
    cluster: Cluster,
    out: Outcome,
    requests: list[dict[str, Any]],
    mla: bool = False,
    failed: frozenset[str] = frozenset(),
) -> None:
    """Every request but those in ``failed`` succeeded on every rank of both sides, every byte
    right; those in ``failed`` failed on both sides; nothing stray, nothing left allocated."""
    with cluster.explain():
        ranks = {side: topo.attn_tp for side, topo in cluster.topo.items()}  # a request's ranks per side
        for req in requests:
            rid = req["rid"]
            pre, dec = out.prefill.get(rid, []), out.decode.get(rid, [])
            assert (len(pre), len(dec)) == (ranks["prefill"], ranks["decode"]), show(rid, ranks, pre, dec)
            if rid in failed:
                assert all(o["state"] == "failed" for o in pre + dec), show(rid, pre, dec)
                continue
            assert all(o["state"] == "success" for o in pre), show(rid, pre)
            assert all(o["state"] == "success" for o in dec), show(rid, dec)
            for o in dec:
                # What SGLang's deferred release would wait for (where the harness saw it)
                assert o.get("sources", cluster.sources) == cluster.sources, show(rid, o, cluster.sources)
                decode_rank = next(r for r in cluster.decode if r.name == o["rank"])
                want = kv_bytes(req["prompt_len"], decode_rank, mla)
                assert o["tokens"] == req["prompt_len"] and o["kv_bytes"] == want, show(rid, o, want)
                want = state_bytes(req["prompt_len"], decode_rank, cluster.page_size)
                assert o["state_bytes"] == want, show(rid, o, want)
        for rank, (count, first) in out.stray_pages.items():
            assert count == 0, f"{rank}: {count} pages written outside every request's pages, e.g. {first}"
        for rank, pools in out.stray_state.items():
            for pool, (count, first) in pools.items():
                assert count == 0, f"{rank}: {count} {pool} written outside every request's, e.g. {first}"
        assert_no_leaks(out)


def show(*items: Any) -> str:
    return "\n".join(json.dumps(item, default=str) for item in items)


def assert_no_leaks(out: Outcome) -> None:
    """Every KV page, request row and metadata slot (and SWA page, mamba slot) is back."""
    for rank, counts in out.leaks.items():
        assert {"kv_tokens", "req_rows", "metadata_slots"} <= set(counts), (rank, counts)
        assert not any(counts.values()), (rank, counts)


def requests(cluster: Cluster, lengths: list[int], **extra: Any) -> list[dict[str, Any]]:
    return [{"rid": f"r{cluster.room()}-{n}", "room": cluster.room(), "prompt_len": n, **extra} for n in lengths]


def chunked(cluster: Cluster, length: int, ends: list[int], **extra: Any) -> dict[str, Any]:
    room = cluster.room()
    return {"rid": f"c{room}", "room": room, "prompt_len": length, "chunks": ends, **extra}


# ---------------------------------------------------------------------------------------------
# Transfers
# ---------------------------------------------------------------------------------------------

LENGTHS = [1, 15, 16, 17, 40, 129]


@pytest.mark.parametrize("driver", ["nixl-ucx", "mooncake-gdr", "mooncake-staged"])
def test_mha_requests_arrive_byte_for_byte(tp1: Cluster, driver: str) -> None:
    """The base case, over each driver, from a fresh instance (the first request of a decode
    rank looks its prefill up and connects): every byte arrives, and no scheduler iteration
    waits on the network (SGLang calls the backend from its event loop)."""
    tp1.configure(driver=driver)
    reqs = requests(tp1, LENGTHS)
    out = tp1.run(reqs)
    assert_all_delivered(tp1, out, reqs)
    with tp1.explain():
        assert max(out.longest_step_s.values()) < STEP_S, show(out.longest_step_s)


@pytest.mark.parametrize("page_size", [1, 64])
def test_page_sizes(tp1: Cluster, page_size: int) -> None:
    tp1.configure(page_size=page_size)
    reqs = requests(tp1, [*LENGTHS, 64, 65, 200])
    out = tp1.run(reqs)
    assert_all_delivered(tp1, out, reqs)


def test_mla_latent_arrives_byte_for_byte(tp1: Cluster) -> None:
    tp1.configure(mla=True)
    reqs = [*requests(tp1, LENGTHS), chunked(tp1, 70, [20, 50, 70])]
    out = tp1.run(reqs)
    assert_all_delivered(tp1, out, reqs, mla=True)


def test_chunked_prefill_sends_every_chunk(tp1: Cluster) -> None:
    """Several chunks per request (boundaries on and off pages), each sent by SGLang's
    process_prefill_chunk -> send_kv_chunk as the next chunk is scheduled, the last by
    send_kv_chunk(last_chunk=True) with the aux row."""
    tp1.configure()
    reqs = [
        chunked(tp1, 100, [16, 40, 64, 100]),
        chunked(tp1, 48, [16, 32, 48]),
        chunked(tp1, 33, [5, 21, 33]),
        chunked(tp1, 200, [60, 61, 130, 200]),
    ]
    out = tp1.run(reqs)
    assert_all_delivered(tp1, out, reqs)


def test_last_chunk_without_new_pages(tp1: Cluster) -> None:
    """The prompt's pages all went out as non-last chunks; the last chunk carries no page, only
    the aux row SGLang writes (MetadataBuffers.set_buf) just before that last send."""
    tp1.configure()
    reqs = [chunked(tp1, 64, [32, 64], zero_page_last=True), chunked(tp1, 32, [32], zero_page_last=True)]
    out = tp1.run(reqs, timeout=8)
    assert_all_delivered(tp1, out, reqs)


def test_sixty_four_concurrent_requests(tp1: Cluster) -> None:
    tp1.configure()
    rng = random.Random(64)
    reqs = []
    for i in range(64):
        n = rng.randint(1, 300)
        if i % 4 == 0 and n > 40:
            cuts = sorted(rng.sample(range(1, n), 2))
            reqs.append(chunked(tp1, n, [*cuts, n]))
        else:
            reqs += requests(tp1, [n])
    out = tp1.run(reqs, timeout=120)
    assert_all_delivered(tp1, out, reqs)


def test_tp2_each_rank_gets_its_own_heads(tp2: Cluster) -> None:
    """TP 2 on both sides: each decode rank must hold exactly its attention-TP rank's KV heads
    (content is a function of the global head), polls all-reduced across the two ranks."""
    tp2.configure()
    reqs = [*requests(tp2, LENGTHS), chunked(tp2, 90, [30, 60, 90])]
    out = tp2.run(reqs)
    assert_all_delivered(tp2, out, reqs)


def test_tp2_many_concurrent_chunked_requests(tp2: Cluster) -> None:
    """Many requests at once under TP 2, a quarter chunked: every poll list is all-reduced in the
    same order on both ranks of a side, whatever order the transfers finish in."""
    tp2.configure()
    rng = random.Random(32)
    reqs = []
    for i in range(32):
        n = rng.randint(1, 200)
        reqs += (
            [chunked(tp2, n, [*sorted(rng.sample(range(1, n), 2)), n])] if i % 4 == 0 and n > 20 else requests(tp2, [n])
        )
    out = tp2.run(reqs, timeout=120)
    assert_all_delivered(tp2, out, reqs)


def test_tp2_mla_latent_on_every_rank(tp2: Cluster) -> None:
    """MLA under TP 2: the latent is replicated, every decode rank gets all of it."""
    tp2.configure(mla=True)
    reqs = [*requests(tp2, [1, 16, 33]), chunked(tp2, 50, [20, 50])]
    out = tp2.run(reqs)
    assert_all_delivered(tp2, out, reqs, mla=True)


def test_dp_attention_routes_rooms_to_both_prefill_ranks(dpa2: Cluster) -> None:
    """tp 2, dp 2, DP attention (attention TP 1) on both sides. A room goes to prefill DP rank
    room % 2 (follow_bootstrap_room); decode's router spreads requests over its DP ranks
    independently, so decode DP rank 0 pulls from both prefill DP ranks and so does rank 1."""
    dpa2.configure()
    assert sorted(r.info["attn_dp_rank"] for r in dpa2.prefill) == [0, 1]
    reqs = []
    for i in range(8):
        room = dpa2.room()
        reqs.append({"rid": f"d{room}", "room": room, "prompt_len": 20 + 9 * i, "decode_dp": (i // 2) % 2})
    assert len({(r["room"] % 2, r["decode_dp"]) for r in reqs}) == 4  # every prefill/decode DP pairing
    out = dpa2.run(reqs, timeout=60)
    assert_all_delivered(dpa2, out, reqs)


def test_dp_attention_honours_a_router_given_prefill_dp_rank(dpa2: Cluster) -> None:
    """A router that picks the prefill DP rank itself (routed_dp_rank to prefill, and
    disagg_prefill_dp_rank to both) may pick one other than room % 2: decode must pull each
    request from that rank."""
    dpa2.configure()
    reqs = []
    for i in range(4):
        room = dpa2.room()
        reqs.append({"rid": f"x{room}", "room": room, "prompt_len": 30 + i, "prefill_dp": (room + 1) % 2})
    out = dpa2.run(reqs, timeout=60)
    assert_all_delivered(dpa2, out, reqs)


def test_the_checks_catch_a_corrupt_page_and_a_stray_write(tp1: Cluster) -> None:
    """The controls: a prefill forward that writes another room's KV into one layer's V makes the
    decode side's check fail; data in a page no request was given counts as a stray write (so
    the other tests' checks can fail)."""
    tp1.configure()
    good, bad = requests(tp1, [40], stray_write=True), requests(tp1, [40], prefill_corrupt=True)
    out = tp1.run(good + bad)
    with tp1.explain():
        assert out.decode[good[0]["rid"]][0]["state"] == "success"
        (d,) = out.decode[bad[0]["rid"]]
        assert d["state"] == "corrupt" and "layer 1 V" in d["error"], show(d)
        assert out.stray_pages["decode0"] == (1, [0]), show(out.stray_pages)


# ---------------------------------------------------------------------------------------------
# Aborts: the other side must fail the request promptly, not when a timer fires
# ---------------------------------------------------------------------------------------------


def _failed_promptly(cluster: Cluster, outcomes: list[dict[str, Any]], since: float) -> None:
    with cluster.explain():
        for o in outcomes:
            assert o["state"] == "failed", show(o)
            assert o["at"] - since < PROMPT_S, f"failed {o['at'] - since:.1f} s after the abort: {show(o)}"


def _pages_back_promptly(cluster: Cluster, outcomes: list[dict[str, Any]]) -> None:
    with cluster.explain():
        for o in outcomes:
            assert o["state"] == "failed", show(o)
            held = o.get("released", float("inf")) - o["at"]
            assert held < PROMPT_S, f"pages held {held:.1f} s after the failure: {show(o)}"


#: What each abort case asks of the two instances: a request of 48 tokens with these fields.
ABORTS: dict[str, dict[str, Any]] = {
    # Decode's client abort (Scheduler.abort_request -> receiver.abort()) once its pages are
    # announced; prefill holds the request bootstrapped, before any forward.
    "decode-transfer-queue": {"decode_abort": "transfer", "prefill_delay": ABORT_TIMEOUT_S},
    # Decode's client abort while the request waits in DecodePreallocQueue for memory: its
    # receiver is ready (waiting_for_input) but its pages were never announced, so prefill's
    # sender waits in PrefillBootstrapQueue. (The pool is small and a first request holds it.)
    "decode-prealloc-queue": {"decode_abort": "prealloc", "prompt_len": 500},
    # Prefill's client abort of a bootstrapped request in its waiting queue
    # (release_aborted_prefill_waiting_req -> sender.abort()); decode waits with pages announced.
    "prefill-waiting-queue": {"prefill_abort": "waiting"},
    # Prefill's client abort in PrefillBootstrapQueue before any decode rank announced the room;
    # the decode request arrives a second later and announces its pages.
    "prefill-bootstrap-queue": {"prefill_abort": "bootstrap", "decode_delay": 1.0},
}
#: The decode pool of the prealloc case: room for the request that holds it, not for a second.
SMALL_POOL = 1024
_abort_runs: dict[tuple[int, str], tuple[dict[str, Any], Outcome]] = {}


def abort_case(cluster: Cluster, case: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]], Outcome]:
    """Run an abort case once per cluster (several tests check its outcome); (decode, prefill)
    outcomes of the request."""
    key = (id(cluster), case)
    if key not in _abort_runs:
        fields = {"prompt_len": 48, **ABORTS[case]}
        (req,) = requests(cluster, [fields.pop("prompt_len")], **fields)
        batch = [req]
        if case == "decode-prealloc-queue":
            cluster.configure(pool_tokens=SMALL_POOL, **ABORT_ENV)
            # Holds decode's memory (its prefill forward comes later) until the abort is done.
            (hog,) = requests(cluster, [500], prefill_delay=2.0)
            batch = [hog, req]
        else:
            cluster.configure(**ABORT_ENV)
        _abort_runs[key] = (req, cluster.run(batch, timeout=ABORT_TIMEOUT_S + 15))
    req, out = _abort_runs[key]
    return out.decode[req["rid"]], out.prefill[req["rid"]], out


def test_abort_from_decode_in_the_transfer_queue_fails_prefill(tp1: Cluster) -> None:
    """Prefill's sender must turn Failed and SGLang's resolve_waiting_queue_bootstrap fail the
    request within seconds of decode's abort."""
    (d,), (p,), out = abort_case(tp1, "decode-transfer-queue")
    with tp1.explain():
        assert d["state"] == "failed" and "abort" in d, show(d)
    _failed_promptly(tp1, [p], d["abort"])
    assert_no_leaks(out)


def test_abort_from_decode_before_the_pages_are_announced_fails_prefill(tp1: Cluster) -> None:
    """Prefill's sender, still in PrefillBootstrapQueue, must learn of decode's abort, not wait
    out SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT."""
    (d,), (p,), out = abort_case(tp1, "decode-prealloc-queue")
    with tp1.explain():
        assert d["state"] == "failed" and "abort" in d and "metadata_sent" not in d, show(d)
        assert "bootstrapped" not in p, show(p)
        assert sorted(o[0]["state"] for o in out.decode.values()) == ["failed", "success"], show(out.decode)
    _failed_promptly(tp1, [p], d["abort"])
    assert_no_leaks(out)


def test_abort_from_prefill_fails_decode(tp1: Cluster) -> None:
    """Decode must fail the request within seconds of prefill's abort."""
    (d,), (p,), out = abort_case(tp1, "prefill-waiting-queue")
    with tp1.explain():
        assert p["state"] == "failed" and "abort" in p, show(p)
    _failed_promptly(tp1, [d], p["abort"])
    assert_no_leaks(out)


def test_abort_from_prefill_before_decode_announces_fails_decode(tp1: Cluster) -> None:
    """Decode, arriving after prefill aborted, must fail within seconds of announcing, not at
    SGLANG_DISAGGREGATION_WAITING_TIMEOUT."""
    (d,), (p,), out = abort_case(tp1, "prefill-bootstrap-queue")
    with tp1.explain():
        assert p["state"] == "failed" and "abort" in p and "bootstrapped" not in p, show(p)
        assert d["state"] == "failed", show(d)
    _failed_promptly(tp1, [d], d["arrived"])
    assert_no_leaks(out)


@pytest.mark.parametrize("case", ["decode-transfer-queue", "prefill-waiting-queue", "prefill-bootstrap-queue"])
def test_decode_gets_failed_pages_back_promptly(tp1: Cluster, case: str) -> None:
    """After a failed transfer SGLang holds decode's pages (deferred KV release,
    decode.py:2894-2925) until the backend says no write can land any more, or 30 s: a backend
    that never says so costs every failed request its pages for that long."""
    (d,), _, _ = abort_case(tp1, case)
    _pages_back_promptly(tp1, [d])


def test_aborts_leave_the_other_requests_alone(tp1: Cluster) -> None:
    """Aborts from both sides among requests that go through: each aborted one fails on both
    sides, every other one arrives byte for byte, nothing stray, nothing left allocated."""
    tp1.configure(**ABORT_ENV)
    reqs = requests(tp1, [20, 40, 60, 80, 100, 120, 140, 160])
    reqs[1].update(ABORTS["decode-transfer-queue"])
    reqs[4].update(ABORTS["prefill-waiting-queue"])
    reqs[6].update(ABORTS["decode-transfer-queue"])
    out = tp1.run(reqs, timeout=ABORT_TIMEOUT_S + 15)
    with tp1.explain():
        assert out.wall_s < ABORT_TIMEOUT_S, f"the run waited for a timer: {out.wall_s:.1f} s"
    assert_all_delivered(tp1, out, reqs, failed=frozenset(reqs[i]["rid"] for i in (1, 4, 6)))


def test_abort_from_decode_under_dp_attention(dpa2: Cluster) -> None:
    """Decode DP rank 0 aborts a request that prefill DP rank room % 2 holds, and a second one
    from the other prefill DP rank: each prefill rank must fail its request promptly."""
    dpa2.configure(**ABORT_ENV)
    room = dpa2.room()
    reqs = [
        {"rid": f"a{room + k}", "room": room + k, "prompt_len": 48, "decode_dp": 0, **ABORTS["decode-transfer-queue"]}
        for k in range(2)
    ]
    out = dpa2.run(reqs, timeout=ABORT_TIMEOUT_S + 15)
    with dpa2.explain():
        assert {o[0]["rank"] for o in out.prefill.values()} == {"prefill0", "prefill1"}, show(out.prefill)
    for req in reqs:
        (d,), pre = out.decode[req["rid"]], out.prefill[req["rid"]]
        with dpa2.explain():
            assert d["state"] == "failed" and "abort" in d, show(d)
        _failed_promptly(dpa2, pre, d["abort"])
    assert_no_leaks(out)


def test_abort_from_decode_with_tp2_fails_every_prefill_rank(tp2: Cluster) -> None:
    """The same decode abort with two ranks a side: each prefill rank's poll is all-reduced
    (MIN) with its peer's, and both must fail the request promptly."""
    dec, pre, out = abort_case(tp2, "decode-transfer-queue")
    with tp2.explain():
        assert all(d["state"] == "failed" and "abort" in d for d in dec), show(dec)
    _failed_promptly(tp2, pre, min(d["abort"] for d in dec))
    assert_no_leaks(out)


def test_failures_injected_by_sglang_on_single_ranks(tp2: Cluster) -> None:
    """SGLang's own fault injection (SGLANG_TEST_DISAGG_FAILURE_PROB: a poll reads Failed at
    random, on one rank) under TP 2: the MIN all-reduce fails the request on the other rank too,
    whose own transfer is alive, at every stage of both sides. Every request still concludes on
    both sides (no crash, no hang; SGLang raises on a poll state a queue does not expect), the
    ranks of a side agree, whatever succeeds is byte-exact, and every page, row and slot goes
    back."""
    tp2.configure(SGLANG_TEST_DISAGG_FAILURE_PROB="0.002", **ABORT_ENV)
    rng = random.Random(7)
    reqs = []
    for i in range(24):
        n = rng.randint(8, 160)
        reqs += [chunked(tp2, n, [n // 3, 2 * n // 3, n])] if i % 3 == 0 else requests(tp2, [n])
    out = tp2.run(reqs, timeout=ABORT_TIMEOUT_S * 3)
    with tp2.explain():
        states = [o["state"] for side in (out.prefill, out.decode) for v in side.values() for o in v]
        assert "timeout" not in states and "corrupt" not in states, show(out.prefill, out.decode)
        # The injection fired. How many requests it leaves alone depends on how often they are
        # polled (a per-poll chance): on a loaded 2-core machine a request lives long enough
        # that every one may fail, so a success is not required; any success is checked above.
        assert states.count("success") < len(states), show(out.prefill, out.decode)
        # Ranks of one side agree on every request (they all-reduce every poll).
        for side in (out.prefill, out.decode):
            for rid, per_rank in side.items():
                assert len({o["state"] for o in per_rank}) == 1, show(rid, per_rank)
    assert_no_leaks(out)


def test_decode_gets_failed_pages_back_promptly_with_tp2(tp2: Cluster) -> None:
    """Deferred release under TP 2: SGLang holds the pages while any rank holds (MAX-reduced
    flags) and releases when every rank's prefill peer confirmed (MIN-reduced)."""
    dec, _, _ = abort_case(tp2, "decode-transfer-queue")
    _pages_back_promptly(tp2, dec)


# ---------------------------------------------------------------------------------------------
# State buffers: hybrid SWA windows and mamba slots, built as SGLang builds them
# ---------------------------------------------------------------------------------------------

#: TINY_GPT_OSS's window as SGLang sets it (sliding_window - 1): three pages of 16.
WINDOW = 48
#: Shorter than the window, the window exactly, one token over, and far longer (only the last
#: WINDOW tokens' pages, from a page boundary, move for the SWA layers).
SWA_LENGTHS = [1, 20, 48, 49, 130]


def state_requests(cluster: Cluster, lengths: list[int]) -> list[dict[str, Any]]:
    """``lengths`` plus chunked requests (SWA slots slide out of the window between chunks; the
    state goes with the last send), one whose last send carries no page, only the aux row and
    the state."""
    return [
        *requests(cluster, lengths),
        chunked(cluster, 200, [70, 140, 200]),
        chunked(cluster, 64, [40, 64]),
        chunked(cluster, 96, [32, 96], zero_page_last=True),
    ]


@pytest.mark.parametrize("driver", ["nixl-ucx", "mooncake-gdr", "mooncake-staged"])
def test_swa_window_arrives_byte_for_byte(tp1: Cluster, driver: str) -> None:
    """A hybrid sliding-window model (SWAKVPool, SWATokenToKVPoolAllocator): the full-attention
    layers' KV of every token, and of the sliding-window layers only the window SGLang's
    _swa_payload names, into the SWA pages decode's tail allocation gave; SWA pages no request
    was given stay zero, and every SWA page goes back on both sides."""
    tp1.configure(model="swa", driver=driver)
    with tp1.explain():
        for r in tp1.ranks:
            assert r.info["state_types"] == ["SWA"] and r.info["sliding_window_size"] == WINDOW, show(r.info)
            assert (r.info["kv_pool"], r.info["allocator"]) == ("SWAKVPool", "SWATokenToKVPoolAllocator"), show(r.info)
    reqs = state_requests(tp1, SWA_LENGTHS)
    out = tp1.run(reqs)
    assert_all_delivered(tp1, out, reqs)


@pytest.mark.parametrize("driver", ["nixl-ucx", "mooncake-gdr"])
def test_mamba_state_arrives_byte_for_byte(tp1: Cluster, driver: str) -> None:
    """A hybrid linear-attention model (HybridLinearKVPool over the request pool's MambaPool;
    HybridReqToTokenPool on prefill, HybridMambaDecodeReqToTokenPool on decode), many requests at
    once: each request's mamba slot, every conv and temporal state tensor of every mamba layer,
    lands in the slot decode gave it (_mamba_payload on both sides), as the state after the whole
    prompt; no other slot is written; every slot goes back on both sides."""
    tp1.configure(model="mamba", driver=driver)
    with tp1.explain():
        assert [(r.info["state_types"], r.info["req_pool"]) for r in tp1.ranks] == [
            (["MAMBA"], "HybridReqToTokenPool"),
            (["MAMBA"], "HybridMambaDecodeReqToTokenPool"),
        ], show([r.info for r in tp1.ranks])
    rng = random.Random(12)
    reqs = state_requests(tp1, [1, 16, 17, *(rng.randint(2, 300) for _ in range(13))])
    out = tp1.run(reqs)
    assert_all_delivered(tp1, out, reqs)


@pytest.mark.parametrize("model", ["swa", "mamba"])
def test_tp2_state_each_rank_gets_its_own(tp2: Cluster, model: str) -> None:
    """TP 2 on both sides: each decode rank's SWA window holds its own KV heads, its mamba slot
    its own share of the state (content is a function of the attention-TP rank)."""
    tp2.configure(model=model)
    reqs = state_requests(tp2, [20, 130])
    out = tp2.run(reqs)
    assert_all_delivered(tp2, out, reqs)


@pytest.mark.parametrize(
    ("model", "where"),
    [pytest.param("swa", "SWA layer 2 V", id="swa"), pytest.param("mamba", "mamba temporal of layer 2", id="mamba")],
)
def test_the_state_checks_catch_corrupt_state_and_a_stray_write(tp1: Cluster, model: str, where: str) -> None:
    """The controls for the state checks: a prefill forward that writes another room's content
    into one state buffer (an SWA layer's V in the window; one mamba tensor of the slot) makes
    decode's check fail; data in an SWA page or mamba slot no request was given counts as a stray
    write."""
    tp1.configure(model=model)
    good, bad = requests(tp1, [130], stray_write="state"), requests(tp1, [130], prefill_corrupt="state")
    out = tp1.run(good + bad)
    pool = "swa_pages" if model == "swa" else "mamba_slots"
    with tp1.explain():
        assert out.decode[good[0]["rid"]][0]["state"] == "success", show(out.decode)
        (d,) = out.decode[bad[0]["rid"]]
        assert d["state"] == "corrupt" and where in d["error"], show(d)
        assert out.stray_state["decode0"] == {pool: (1, [0])}, show(out.stray_state)
        assert out.stray_pages["decode0"] == (0, []), show(out.stray_pages)


@pytest.mark.parametrize("model", ["swa", "mamba"])
def test_aborts_with_state_give_every_slot_back(tp1: Cluster, model: str) -> None:
    """Aborts from both sides among requests with state that go through: decode's in its transfer
    queue, prefill's of a bootstrapped request, and prefill's of a chunked request that holds
    KV, SWA pages or a mamba slot, and already sent a chunk (Scheduler.process_pending_chunked_abort).
    The aborted ones fail on both sides, promptly; the others arrive byte for byte; every SWA
    page and mamba slot (the aborted requests' too) is back on both sides."""
    tp1.configure(model=model, **ABORT_ENV)
    reqs = [*requests(tp1, [20, 60, 130, 90]), chunked(tp1, 200, [70, 140, 200], prefill_abort="chunking")]
    reqs[1].update(ABORTS["decode-transfer-queue"])
    reqs[2].update(ABORTS["prefill-waiting-queue"])
    out = tp1.run(reqs, timeout=ABORT_TIMEOUT_S + 15)
    with tp1.explain():
        assert out.wall_s < ABORT_TIMEOUT_S, f"the run waited for a timer: {out.wall_s:.1f} s"
        assert {k for c in out.leaks.values() for k in c} >= {"swa_tokens" if model == "swa" else "mamba_slots"}
        (p,) = out.prefill[reqs[4]["rid"]]
        assert p["state"] == "failed" and "abort" in p and "bootstrapped" in p, show(p)
    _failed_promptly(tp1, out.decode[reqs[4]["rid"]], p["abort"])
    _pages_back_promptly(tp1, out.decode[reqs[4]["rid"]])
    assert_all_delivered(tp1, out, reqs, failed=frozenset(reqs[i]["rid"] for i in (1, 2, 4)))


# ---------------------------------------------------------------------------------------------
# Decode-side radix cache (--disaggregation-decode-enable-radix-cache): decode_prefix_len > 0
# ---------------------------------------------------------------------------------------------


def prefix_requests(
    cluster: Cluster, seed_len: int, cases: list[tuple[int, int]], **extra: Any
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A request that leaves ``seed_len`` tokens of a fresh prompt in decode's radix tree (it
    finishes on decode with the token prefill sampled: max_new_tokens 1), and for each case
    ``(prompt_len, shared)`` a request whose prompt starts with the first ``shared`` tokens of
    it, sent to decode once the first one concluded there (so its prefix is in the tree)."""
    seed = cluster.room()
    first = {"rid": f"p{seed}", "room": cluster.room(), "prompt_len": seed_len, "shared_prefix": [seed, seed_len]}
    first["max_new_tokens"] = 1
    followers = []
    for i, (n, shared) in enumerate(cases):
        room = cluster.room()
        spec = {"rid": f"s{room}-{n}-{shared}", "room": room, "prompt_len": n, "shared_prefix": [seed, shared]}
        # Alternately finished by process_batch_result_prebuilt and as a last decode step would.
        followers.append({**spec, "max_new_tokens": 1 + 3 * (i % 2), "decode_after": [first["rid"]], **extra})
    return first, followers


def wire_bytes(tokens: int, prefix: int, rank: Rank, page_size: int) -> int:
    """What prefill's transfer metric must count for a request after decode's ``prefix`` (with
    ``rank`` a prefill rank, under equal TP; with a decode rank: what it receives, from all its
    sources together): the whole pages from the prefix on in every KV buffer (item lengths are
    a page's), the aux row, and the state: the pages of the SWA window (from max(prefix,
    tokens - window), page-aligned), or the request's mamba slot (all of it, whatever decode
    holds)."""
    info = rank.info
    pages = -(-(tokens - prefix) // page_size)
    total = pages * sum(info["kv_item_lens"]) + sum(info["aux_item_lens"])
    for kind, lens in zip(info["state_types"], info["state_item_lens"], strict=True):
        if kind == "SWA":
            start = max(prefix, tokens - int(info["sliding_window_size"])) // page_size * page_size
            total += -(-(tokens - start) // page_size) * sum(lens)
        else:
            assert kind == "MAMBA", kind
            total += sum(lens)
    return int(total)


def assert_prefix_reused(
    cluster: Cluster, out: Outcome, first: dict[str, Any], followers: list[dict[str, Any]], want: list[int]
) -> None:
    """Everything arrived byte for byte, the whole prompt of every request (the prefix pages
    decode's tree gave, filled by the first request, and the pages prefill sent); decode
    promised prefill ``want[i]`` tokens for follower i (none for the first), prefill read that
    as decode_prefix_len and its transfer carried only the pages after it; nothing stray,
    nothing leaked (what the tree keeps unlocked aside), and the tree holds the prompts."""
    reqs = [first, *followers]
    assert_all_delivered(cluster, out, reqs)
    with cluster.explain():
        for req, prefix in zip(reqs, [0, *want], strict=True):
            for side in (out.prefill, out.decode):
                got = [o["decode_prefix_len"] for o in side[req["rid"]]]
                assert got == [prefix] * len(got), show(req, side[req["rid"]], prefix)
            for o in out.prefill[req["rid"]]:
                rank = next(r for r in cluster.prefill if r.name == o["rank"])
                expected = wire_bytes(req["prompt_len"], prefix, rank, cluster.page_size)
                assert o["sent_bytes"] == expected, show(req, o, expected)
        cached = first["prompt_len"] // cluster.page_size * cluster.page_size
        assert all(n >= cached for n in out.tree_tokens.values()), show(out.tree_tokens)


CACHED_LEN = 160
#: (prompt length, tokens shared with the cached prompt) and the prefix decode's tree matches: a
#: prefix of whole pages, a prompt that shares a non page-aligned 40 or 100 tokens (SGLang's tree
#: matches whole pages: 32, 96, and prefill sends from the page the shared tokens end in), a
#: prompt of exactly the cached pages (decode holds all of it: prefill sends no page, only the
#: aux row), one that is all cached but for its last, partial page, and a chunked one (below).
PREFIX_CASES = [(200, 160), (100, 40), (140, 100), (96, 96), (170, 160), (230, 160)]
PREFIX_WANT = [160, 32, 96, 96, 160, 160]


@pytest.mark.parametrize("driver", ["nixl-ucx", "mooncake-gdr"])
def test_decode_radix_cache_prefix_is_not_sent_again(tp1: Cluster, driver: str) -> None:
    """Decode's radix tree (SGLang's UnifiedRadixCache, enabled) holds the prompt of a request it
    finished (release_kv_cache -> tree insert). Requests whose prompts start with it are matched
    by DecodePreallocQueue (_match_prefix_and_lock), get pages only after the prefix
    (_pre_alloc), and announce decode_prefix_len; SGLang's prefill sends only what follows it
    (finalize_bootstrap -> start_send_idx), also chunked (the chunks before the prefix send
    nothing). Decode then checks every byte of each whole prompt."""
    tp1.configure(driver=driver, decode_radix_cache=True)
    first, followers = prefix_requests(tp1, CACHED_LEN, PREFIX_CASES)
    followers[-1]["chunks"] = [60, 170, 230]  # the first chunk ends inside the prefix, the second a page after it
    out = tp1.run([first, *followers])
    assert_prefix_reused(tp1, out, first, followers, PREFIX_WANT)


def test_decode_radix_cache_prefix_with_page_size_1(tp1: Cluster) -> None:
    """Page size 1: decode's tree matches to the token, so decode_prefix_len need not be a
    multiple of anything (37, 101), and a prompt decode holds whole leaves prefill nothing to
    send but the aux row."""
    tp1.configure(page_size=1, decode_radix_cache=True)
    first, followers = prefix_requests(tp1, 120, [(90, 37), (150, 101), (120, 120), (64, 64)])
    out = tp1.run([first, *followers])
    assert_prefix_reused(tp1, out, first, followers, [37, 101, 120, 64])


#: TINY_GPT_OSS (window 48): decode allocates the SWA tail fresh and matches only what lies
#: before it (_match_prefix_and_lock's max_prefix_len: with the radix cache the tail starts at
#: page_floor(len - 1 - window), _swa_tail_len), and SGLang's unified tree takes a match point only
#: where the sliding-window KV of the window before it is still in the tree (the first request's
#: decode held SWA KV only for its tail, [96, 160)).
SWA_PREFIX_CASES = [(200, 160), (220, 160), (220, 150), (100, 40), (160, 160)]
#: 200: capped at 144 (its tail starts there); 220: capped at 160; 150 shared: page floor 144;
#: 40 shared: a match at 32 would need SWA KV of [0, 32), never held: none; 160 of 160: capped
#: at 96, whose window [48, 96) was never held either: none.
SWA_PREFIX_WANT = [144, 160, 144, 0, 0]


def test_decode_radix_cache_prefix_with_hybrid_swa(tp1: Cluster) -> None:
    """A hybrid sliding-window model (gpt-oss) with decode's radix cache (SGLang allows it:
    validate_decode_radix_cache; the tree gets the FULL and SWA components): the full-attention
    prefix comes from the tree, the SWA window is transferred fresh into newly allocated tail
    pages (_swa_payload on both sides starts it at max(decode_prefix_len, len - window))."""
    tp1.configure(model="swa", decode_radix_cache=True)
    first, followers = prefix_requests(tp1, CACHED_LEN, SWA_PREFIX_CASES)
    out = tp1.run([first, *followers])
    assert_prefix_reused(tp1, out, first, followers, SWA_PREFIX_WANT)


#: A hybrid linear-attention model's tree matches only where it holds a mamba state: the end of
#: the cached prompt (with SGLang's no_buffer strategy, no state is kept inside a prompt).
MAMBA_PREFIX_CASES = [(90, 37), (150, 101), (120, 120), (150, 120)]
MAMBA_PREFIX_WANT = [0, 0, 120, 120]


def test_decode_radix_cache_prefix_with_mamba(tp1: Cluster) -> None:
    """A hybrid linear-attention model (Qwen3-Next) with decode's radix cache, as SGLang allows
    it on this platform: its mamba radix cache resolves to the no_buffer strategy only with
    page size 1 and --disable-overlap-schedule (extra_buffer needs CUDA-like state snapshots).
    A prefix match copies the tree's state into the request's slot (copy-on-write); prefill
    still sends the whole state after the last token, and only the KV after the prefix."""
    tp1.configure(model="mamba", page_size=1, decode_radix_cache=True, disable_overlap_schedule=True)
    first, followers = prefix_requests(tp1, 120, MAMBA_PREFIX_CASES)
    out = tp1.run([first, *followers])
    assert_prefix_reused(tp1, out, first, followers, MAMBA_PREFIX_WANT)


def test_decode_radix_cache_evicts_for_room(tp1: Cluster) -> None:
    """Decode's tree gives pages back when decode needs the room: three prompts in turn leave
    288 tokens each in the tree of a 1024-token pool; a fourth request of 300 tokens does not
    fit beside them, and SGLang's _pre_alloc evicts (evict_for_alloc) the least recently used
    one. A request sharing that evicted prompt then gets no prefix, one sharing the last
    prompt gets its 288 tokens; every byte arrives and the accounting holds (evicted pages are
    the allocator's again, nothing leaked)."""
    tp1.configure(pool_tokens=SMALL_POOL, decode_radix_cache=True)
    cached = [prefix_requests(tp1, 300, [])[0] for _ in range(3)]
    for before, after in itertools.pairwise(cached):
        after["decode_after"] = [before["rid"]]
    (needs_room,) = requests(tp1, [300], decode_after=[cached[-1]["rid"]], max_new_tokens=1)
    late = []
    for source in (cached[0], cached[-1]):
        room = tp1.room()
        spec = {"rid": f"l{room}", "room": room, "prompt_len": 320, "shared_prefix": source["shared_prefix"]}
        late.append({**spec, "decode_after": [needs_room["rid"]]})
    out = tp1.run([*cached, needs_room, *late])
    assert_prefix_reused(tp1, out, cached[0], [*cached[1:], needs_room, *late], [0, 0, 0, 0, 288])


def test_decode_radix_cache_prefix_with_tp2(tp2: Cluster) -> None:
    """TP 2 on both sides: each decode rank's own tree holds its heads of the cached prompt,
    both match the same prefix (SGLang's tree calls are rank-consensus), and each prefill rank
    sends its heads of the pages after it."""
    tp2.configure(decode_radix_cache=True)
    first, followers = prefix_requests(tp2, CACHED_LEN, PREFIX_CASES[:3])
    out = tp2.run([first, *followers])
    assert_prefix_reused(tp2, out, first, followers, PREFIX_WANT[:3])


def test_decode_radix_cache_the_prefix_bytes_are_checked(tp1: Cluster) -> None:
    """The control: the request whose prompt decode's tree keeps had another prompt's V written
    into layer 1 by its prefill forward; the request that reuses its prefix from the tree must
    fail decode's check within that prefix (pages prefill never sent it)."""
    tp1.configure(decode_radix_cache=True)
    first, (follower,) = prefix_requests(tp1, 64, [(100, 64)])
    first["prefill_corrupt"] = True
    out = tp1.run([first, follower])
    with tp1.explain():
        (d,), (f,) = out.decode[first["rid"]], out.decode[follower["rid"]]
        assert d["state"] == "corrupt" and "layer 1 V" in d["error"], show(d)
        assert f["state"] == "corrupt" and f["decode_prefix_len"] == 64, show(f)
        where = re.search(r"first at position (\d+)", f["error"])
        assert where is not None and "layer 1 V" in f["error"] and int(where.group(1)) < 64, show(f)
        assert out.prefill[follower["rid"]][0]["decode_prefix_len"] == 64, show(out.prefill)
    assert_no_leaks(out)


# ---------------------------------------------------------------------------------------------
# Unequal attention TP: prefill and decode shard the KV heads differently
# ---------------------------------------------------------------------------------------------


def assert_sent_once(cluster: Cluster, out: Outcome, requests: list[dict[str, Any]], mla: bool = False) -> None:
    """What the request's prefill ranks say they sent (SGLang's transfer metric, summed over
    them) is what its decode ranks hold, each byte once: a head (or MLA's replicated latent)
    that two sources both wrote, or one a source left out, shows here even when the content
    checks pass. With MLA and a wider prefill exactly one prefill rank sends anything."""
    with cluster.explain():
        for req in requests:
            pre, dec = out.prefill[req["rid"]], out.decode[req["rid"]]
            decode_ranks = [next(r for r in cluster.decode if r.name == o["rank"]) for o in dec]
            want = sum(wire_bytes(req["prompt_len"], 0, r, cluster.page_size) for r in decode_ranks)
            sent = [int(o["sent_bytes"] or 0) for o in pre]
            assert sum(sent) == want, show(req["rid"], pre, want)
            if mla and len(pre) > len(dec):
                assert len([n for n in sent if n]) == len(dec), show(req["rid"], pre)


def unequal_requests(cluster: Cluster, lengths: list[int]) -> list[dict[str, Any]]:
    """``lengths`` and chunked requests (boundaries on and off pages, one whose last send
    carries no page, only the aux row)."""
    return [
        *requests(cluster, lengths),
        chunked(cluster, 100, [16, 40, 64, 100]),
        chunked(cluster, 33, [5, 21, 33]),
        chunked(cluster, 64, [32, 64], zero_page_last=True),
    ]


def assert_aborts_fail_every_rank(
    cluster: Cluster, out: Outcome, reqs: list[dict[str, Any]], aborted: dict[int, str]
) -> None:
    """The requests of ``aborted`` (index -> the side that aborted) failed on every rank of
    both sides, the other side's promptly; decode held each announced one's pages for the
    drain of every source it has, and got them back promptly; the rest arrived byte for byte,
    nothing stray, nothing leaked."""
    with cluster.explain():
        assert out.wall_s < ABORT_TIMEOUT_S, f"the run waited for a timer: {out.wall_s:.1f} s"
    for i, side in aborted.items():
        rid = reqs[i]["rid"]
        pre, dec = out.prefill[rid], out.decode[rid]
        mine, theirs = (pre, dec) if side == "prefill" else (dec, pre)
        with cluster.explain():
            assert all(o["state"] == "failed" and "abort" in o for o in mine), show(rid, mine)
            assert all(o.get("sources") == cluster.sources for o in dec), show(rid, dec, cluster.sources)
        _failed_promptly(cluster, theirs, min(o["abort"] for o in mine))
        _pages_back_promptly(cluster, dec)
    assert_all_delivered(cluster, out, reqs, failed=frozenset(reqs[i]["rid"] for i in aborted))


def unequal_abort_run(cluster: Cluster, model: str = "llama") -> tuple[list[dict[str, Any]], Outcome]:
    """Requests that go through, and aborts: decode's of a request in its transfer queue (pages
    announced to every source), prefill's of a bootstrapped one, and prefill's of a chunked one
    whose first chunk went out (mid-transfer)."""
    cluster.configure(model=model, **ABORT_ENV)
    reqs = [*requests(cluster, [20, 60, 90, 130]), chunked(cluster, 200, [70, 140, 200], prefill_abort="chunking")]
    reqs[1].update(ABORTS["decode-transfer-queue"])
    reqs[2].update(ABORTS["prefill-waiting-queue"])
    return reqs, cluster.run(reqs, timeout=ABORT_TIMEOUT_S + 15)


UNEQUAL_ABORTED = {1: "decode", 2: "prefill", 4: "prefill"}


@pytest.mark.parametrize("page_size", [16, 1])
def test_prefill_tp2_decode_tp1_heads_from_both_ranks(p2d1: Cluster, page_size: int) -> None:
    """Prefill TP 2 (one KV head a rank), decode TP 1 (both): the decode rank announces its pages
    to both prefill ranks (SGLang's target ranks of a wider prefill), each writes its head into
    every token, and the request succeeds once both finished; every byte of both heads checked,
    sent once (the transfer metric), the receiver lists both ranks."""
    p2d1.configure(page_size=page_size)
    with p2d1.explain():
        assert [r.info["kv_heads"] for r in p2d1.ranks] == [1, 1, 2], show([r.info for r in p2d1.ranks])
    reqs = unequal_requests(p2d1, LENGTHS)
    # The control: prefill rank 1's forward writes another prompt's V of its head into layer 1.
    (bad,) = requests(p2d1, [40], prefill_corrupt=True, corrupt_rank=1)
    out = p2d1.run([*reqs, bad])
    with p2d1.explain():
        (d,) = out.decode[bad["rid"]]
        assert d["state"] == "corrupt" and "layer 1 V" in d["error"], show(d)
    assert_all_delivered(p2d1, out, reqs)
    assert_sent_once(p2d1, out, reqs)


def test_prefill_tp2_decode_tp1_mla_latent_from_one_rank(p2d1: Cluster) -> None:
    """MLA: the latent is replicated on both prefill ranks; decode gets it from one of them, the
    other sends nothing and still completes its part (decode counts both)."""
    p2d1.configure(mla=True)
    reqs = unequal_requests(p2d1, [1, 16, 40])
    out = p2d1.run(reqs)
    assert_all_delivered(p2d1, out, reqs, mla=True)
    assert_sent_once(p2d1, out, reqs, mla=True)


def test_prefill_tp2_decode_tp1_state_buffers_are_refused_with_the_reason(p2d1: Cluster) -> None:
    """A hybrid sliding-window model: each rank's SWA window pages hold its own heads, which
    kvtransport does not slice yet. Decode fails the request at the handshake with the reason
    (not a timeout, not wrong bytes); prefill, which no decode rank could announce to, fails it
    at SGLang's bootstrap timeout; nothing leaks on either side."""
    p2d1.configure(model="swa", SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT=str(SHORT_S))
    reqs = state_requests(p2d1, [20])
    out = p2d1.run(reqs, timeout=30)
    with p2d1.explain():
        for req in reqs:
            pre, dec = out.prefill.get(req["rid"], []), out.decode.get(req["rid"], [])
            assert len(pre) == 2 and len(dec) == 1, show(pre, dec)
            assert all(o["state"] == "failed" for o in pre + dec), show(pre, dec)
            assert "state buffers (swa)" in dec[0]["error"] and "equal TP sizes only" in dec[0]["error"], show(dec)
            assert all("bootstrap" in o["error"].lower() for o in pre), show(pre)
    assert_no_leaks(out)


def test_prefill_tp2_decode_tp1_aborts_fail_every_rank(p2d1: Cluster) -> None:
    """Decode's abort reaches both prefill ranks; either prefill abort (bootstrapped, and
    mid-transfer of a chunked request) fails decode promptly, though the other source's part
    is alive; decode holds the pages until both sources drained; every page, row and slot is
    back on both sides."""
    reqs, out = unequal_abort_run(p2d1)
    assert_aborts_fail_every_rank(p2d1, out, reqs, UNEQUAL_ABORTED)


def test_prefill_dpa_into_decode_tp2_each_rank_gets_its_head(dpa2d2: Cluster) -> None:
    """Prefill under DP attention (attention TP 1 a DP rank, both KV heads) and decode TP 2 (one
    head a rank): a room goes to prefill DP rank room % 2; both decode ranks find that DP rank's
    one attention-TP rank, announce to it, and get their own head from it (each its aux row);
    both prefill DP ranks serve requests."""
    dpa2d2.configure()
    with dpa2d2.explain():
        assert [r.info["kv_heads"] for r in dpa2d2.ranks] == [2, 2, 1, 1], show([r.info for r in dpa2d2.ranks])
        assert [r.info["attn_dp_rank"] for r in dpa2d2.prefill] == [0, 1], show([r.info for r in dpa2d2.ranks])
    reqs = unequal_requests(dpa2d2, LENGTHS)
    out = dpa2d2.run(reqs)
    with dpa2d2.explain():
        assert {o[0]["rank"] for o in out.prefill.values()} == {"prefill0", "prefill1"}, show(out.prefill)
    assert_all_delivered(dpa2d2, out, reqs)
    assert_sent_once(dpa2d2, out, reqs)


def test_prefill_dpa_into_decode_tp2_mla_latent_on_every_rank(dpa2d2: Cluster) -> None:
    """MLA: the one prefill rank of the room's DP rank sends each decode rank the whole latent."""
    dpa2d2.configure(mla=True)
    reqs = unequal_requests(dpa2d2, [1, 16, 40])
    out = dpa2d2.run(reqs)
    assert_all_delivered(dpa2d2, out, reqs, mla=True)
    assert_sent_once(dpa2d2, out, reqs, mla=True)


def test_prefill_dpa_into_decode_tp2_aborts_fail_every_rank(dpa2d2: Cluster) -> None:
    """Decode's abort (on both decode ranks) reaches the room's prefill rank; that rank's aborts
    (bootstrapped, and mid-transfer) reach both decode ranks it feeds, promptly; every page,
    row and slot is back on both sides."""
    reqs, out = unequal_abort_run(dpa2d2)
    assert_aborts_fail_every_rank(dpa2d2, out, reqs, UNEQUAL_ABORTED)


# ---------------------------------------------------------------------------------------------
# SGLang's timeouts
# ---------------------------------------------------------------------------------------------

SHORT_S = 3


def test_ranks_that_start_before_the_bootstrap_server_serve_once_it_is_up(tp1: Cluster) -> None:
    """SGLang starts its bootstrap server in the TokenizerManager, beside the schedulers: here it
    comes up 8 s after every rank started, later than the prefill manager waits for it (5 s).
    The prefill rank goes on registering in the background, decode's requests wait in SGLang's
    pending list (try_ensure_parallel_info answers False, never blocks), and all of them arrive
    once the server is up."""
    tp1.configure(registry_delay=8.0)
    reqs = requests(tp1, [40, 48, 56, 64])
    out = tp1.run(reqs, timeout=40)
    assert_all_delivered(tp1, out, reqs)
    assert out.wall_s >= 1.5, f"the run took {out.wall_s:.1f} s: the requests cannot have waited for the registry"


def test_sglang_waiting_timeout_fails_both_sides(tp1: Cluster) -> None:
    """Decode announced its pages and prefill never computes the request:
    SGLANG_DISAGGREGATION_WAITING_TIMEOUT (not kvtransport's 300 s default) fails it on decode,
    and prefill, whose request waits bootstrapped, hears of it."""
    tp1.configure(
        SGLANG_DISAGGREGATION_WAITING_TIMEOUT=str(SHORT_S), SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT=str(SHORT_S)
    )
    (req,) = requests(tp1, [30], prefill_delay=1000)
    out = tp1.run([req], timeout=30)
    (d,), (p,) = out.decode[req["rid"]], out.prefill[req["rid"]]
    with tp1.explain():
        assert d["state"] == "failed" and p["state"] == "failed", show(d, p)
        assert SHORT_S - 0.5 <= d["at"] - d["metadata_sent"] < SHORT_S + PROMPT_S, show(d)
        assert p["at"] - d["at"] < PROMPT_S, show(d, p)
    assert_no_leaks(out)


def test_sglang_bootstrap_timeout_fails_an_unannounced_prefill_request(tp1: Cluster) -> None:
    """No decode rank ever takes the request: SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT fails it
    in PrefillBootstrapQueue (handle_bootstrap_failure), counted from the sender's creation."""
    tp1.configure(SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT=str(SHORT_S))
    (req,) = requests(tp1, [30], prefill_only=True)
    out = tp1.run([req], timeout=30)
    (p,) = out.prefill[req["rid"]]
    with tp1.explain():
        assert p["state"] == "failed" and "bootstrap" in p["error"].lower(), show(p)
        assert SHORT_S - 0.5 <= p["at"] - p["created"] < SHORT_S + PROMPT_S, show(p)
    assert_no_leaks(out)


# ---------------------------------------------------------------------------------------------
# Layer-wise sends (KVTRANSPORT_LAYERWISE=1): each chunk leaves layer by layer as SGLang's
# run_batch writes it through the pools' set_kv_buffer
# ---------------------------------------------------------------------------------------------

#: Chunks of at least 16 tokens go layer-wise here (the default minimum, 128, would leave most of
#: these prompts whole).
LAYERWISE_MIN = 16
#: And each layer takes 5 ms to compute after its KV is written: a layer sent before its write
#: would reach decode with the pool's old bytes, which decode's checks catch.
LAYERWISE: dict[str, Any] = {"KVTRANSPORT_LAYERWISE_MIN_TOKENS": str(LAYERWISE_MIN), "layer_compute_s": 0.005}


@pytest.fixture(scope="module")
def tp1_layerwise() -> Iterator[Cluster]:
    """TP 1 with KVTRANSPORT_LAYERWISE=1 in every rank's environment from its start: SGLang's
    load_plugins runs the plugin, which installs the hooks around Scheduler.run_batch and the
    pools' writes."""
    yield from spawn("tp1-layerwise", Topo(tp=1), env={"KVTRANSPORT_LAYERWISE": "1"})


def chunk_tokens(req: dict[str, Any], page_size: int, prefix: int = 0) -> list[int]:
    """The tokens each of a request's sends carries, as SGLang's _send_kv_chunk cuts them: a
    middle chunk up to its last whole page, the last one to the end of the prompt."""
    n, out, start = req["prompt_len"], [], prefix
    for end in req.get("chunks", [n]):
        stop = end if end >= n else end - end % page_size
        if stop > start:
            out.append(stop - start)
            start = stop
    return out


def assert_went_layerwise(cluster: Cluster, out: Outcome, reqs: list[dict[str, Any]], prefix: int = 0) -> None:
    """Each chunk of at least LAYERWISE_MIN tokens left layer by layer: one stream each, in at
    least as many groups as the model has layers (the policy starts one layer a group, and the
    writes here are far apart); shorter chunks went whole, after the forward."""
    with cluster.explain():
        for req in reqs:
            if req.get("prefill_abort") or req.get("decode_abort"):
                continue
            want = sum(1 for t in chunk_tokens(req, cluster.page_size, prefix) if t >= LAYERWISE_MIN)
            for o in out.prefill[req["rid"]]:
                chunks, groups = o["layerwise"]
                assert chunks == want, show(req, o, want)
                assert groups >= 2 * chunks, show(req, o)


@pytest.mark.parametrize("driver", ["nixl-ucx", "mooncake-gdr", "mooncake-staged"])
def test_layerwise_requests_arrive_byte_for_byte(tp1_layerwise: Cluster, driver: str) -> None:
    """Whole prompts, chunked ones (boundaries on and off pages: a middle chunk's partial page
    goes again with the next), and one whose pages all went before its last send: every chunk
    of at least the minimum length leaves layer by layer, the shorter ones whole, and every byte
    arrives."""
    c = tp1_layerwise
    c.configure(driver=driver, **LAYERWISE)
    reqs = [
        *requests(c, [1, 15, 16, 17, 40, 129]),
        chunked(c, 100, [16, 40, 64, 100]),
        chunked(c, 200, [60, 61, 130, 200]),
        chunked(c, 64, [32, 64], zero_page_last=True),
    ]
    out = c.run(reqs)
    assert_all_delivered(c, out, reqs)
    assert_went_layerwise(c, out, reqs)


@pytest.mark.parametrize("case", ["mla", "page-size-1", "page-size-64"])
def test_layerwise_mla_and_page_sizes(tp1_layerwise: Cluster, case: str) -> None:
    """MLA's latent (one buffer a layer, written with MLATokenToKVPool.set_kv_buffer), and
    pages of 1 and 64 tokens."""
    c = tp1_layerwise
    c.configure(mla=case == "mla", page_size={"page-size-1": 1, "page-size-64": 64}.get(case, 16), **LAYERWISE)
    reqs = [*requests(c, [17, 64, 65, 200]), chunked(c, 150, [20, 100, 150])]
    out = c.run(reqs)
    assert_all_delivered(c, out, reqs, mla=case == "mla")
    assert_went_layerwise(c, out, reqs)


@pytest.mark.parametrize("model", ["swa", "mamba"])
def test_layerwise_with_state(tp1_layerwise: Cluster, model: str) -> None:
    """Models with state: the full-attention layers go layer by layer (SWAKVPool and
    HybridLinearKVPool hand their writes to the MHA pool the hook wraps), the sliding-window
    layers' writes are not this rank's KV regions and mark nothing, and the state goes with the
    last send, byte for byte."""
    c = tp1_layerwise
    c.configure(model=model, **LAYERWISE)
    reqs = state_requests(c, [16, 40, 130])
    out = c.run(reqs)
    assert_all_delivered(c, out, reqs)
    assert_went_layerwise(c, out, reqs)


def test_layerwise_decode_radix_cache_prefix(tp1_layerwise: Cluster) -> None:
    """Decode holds a prefix (decode_prefix_len): prefill's sends start after it
    (finalize_bootstrap -> start_send_idx), and so do its streams; the wire carries only the
    pages after the prefix."""
    c = tp1_layerwise
    c.configure(decode_radix_cache=True, **LAYERWISE)
    first, followers = prefix_requests(c, CACHED_LEN, [(200, 160), (140, 100), (230, 160)])
    followers[-1]["chunks"] = [60, 170, 230]
    out = c.run([first, *followers])
    assert_prefix_reused(c, out, first, followers, [160, 96, 160])
    with c.explain():
        assert all(o["layerwise"][0] >= 1 for r in followers for o in out.prefill[r["rid"]]), show(out.prefill)


def test_layerwise_forward_whose_writes_no_hook_sees(tp1_layerwise: Cluster) -> None:
    """A forward that writes the KV buffers without the pools' set_kv_buffer (an FP4 pool's own
    write, a CUDA graph replay): its streams open when run_batch returns and every layer is
    marked then, in one group a chunk; every byte arrives."""
    c = tp1_layerwise
    c.configure(direct_kv_writes=True, **LAYERWISE)
    reqs = [*requests(c, [17, 130]), chunked(c, 100, [40, 100])]
    out = c.run(reqs)
    assert_all_delivered(c, out, reqs)
    with c.explain():
        for req in reqs:
            want = sum(1 for t in chunk_tokens(req, c.page_size) if t >= LAYERWISE_MIN)
            (p,) = out.prefill[req["rid"]]
            assert p["layerwise"] == [want, want], show(req, p)


def test_layerwise_aborts_from_both_sides(tp1_layerwise: Cluster) -> None:
    """Aborts among layer-wise requests: decode's in its transfer queue, prefill's of a
    bootstrapped request, and prefill's of a chunked request with a chunk already gone layer by
    layer. The aborted ones fail on both sides; the others arrive byte for byte; nothing leaks."""
    c = tp1_layerwise
    c.configure(**ABORT_ENV, **LAYERWISE)
    reqs = [*requests(c, [20, 60, 130, 90]), chunked(c, 200, [70, 140, 200], prefill_abort="chunking")]
    reqs[1].update(ABORTS["decode-transfer-queue"])
    reqs[2].update(ABORTS["prefill-waiting-queue"])
    out = c.run(reqs, timeout=ABORT_TIMEOUT_S + 15)
    assert_all_delivered(c, out, reqs, failed=frozenset(reqs[i]["rid"] for i in (1, 2, 4)))
    with c.explain():
        (p,) = out.prefill[reqs[4]["rid"]]
        assert p["layerwise"][0] >= 1, show(p)  # its first chunk had gone layer by layer
    assert_went_layerwise(c, out, [reqs[0], reqs[3]])


# ---------------------------------------------------------------------------------------------
# A prefill instance that dies (last: every process of the cluster restarts after it)
# ---------------------------------------------------------------------------------------------


def test_prefill_killed_fails_the_waiting_decode_requests_promptly(tp1: Cluster) -> None:
    """Decode waits in DecodeTransferQueue with its pages announced (and one request still in
    DecodePreallocQueue's pending lookups would be the same); the prefill process is killed:
    every decode request must fail within the heartbeat timeout (peer lost), its pages go back
    (after SGLang's deferred release: a dead prefill confirms nothing), nothing leaks."""
    tp1.configure(**ABORT_ENV)
    reqs = requests(tp1, [16, 40, 100], prefill_delay=ABORT_TIMEOUT_S)
    out = tp1.run(reqs, timeout=ABORT_TIMEOUT_S + 15, kill_prefill_after=2.0)
    with tp1.explain():
        for req in reqs:
            (d,) = out.decode[req["rid"]]
            assert d["state"] == "failed", show(d)
            assert d["at"] - out.killed_at < PROMPT_S, (
                f"failed {d['at'] - out.killed_at:.1f} s after the kill: {show(d)}"
            )
        assert out.leaks["decode0"] == {"kv_tokens": 0, "req_rows": 0, "metadata_slots": 0}, show(out.leaks)
