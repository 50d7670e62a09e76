"""Zero-patch enablement: the core distribution's ``sglang.srt.plugins`` entry point, exercised
through SGLang's own ``load_plugins()``, its server-argument parser and its ``get_kv_class``,
each in a fresh process (SGLang loads plugins once per process, as a server does).

SGLang's scheduler modules need ``transformers`` and friends (tests/requirements-sglang.txt) and
a ``torchvision`` stand-in (tests/stand_ins/README.md), put on the child's ``PYTHONPATH``.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from pathlib import Path

import pytest

pytest.importorskip("sglang.srt.plugins", reason="needs sglang==0.5.23 (bash scripts/dev setup)")
pytest.importorskip("transformers", reason="needs SGLang's import-time dependencies (tests/requirements-sglang.txt)")

STAND_INS = Path(__file__).resolve().parent / "stand_ins"
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 2048,
    "torch_dtype": "bfloat16",
}

# Runs in the child: what a `python -m sglang.launch_server ...` process does before it serves
# (load_plugins, then prepare_server_args), then what its schedulers resolve.
CHILD = textwrap.dedent(
    """
    import json, sys
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.server_args import prepare_server_args
    argv = ["--model-path", "unused", "--disaggregation-mode", "prefill",
            "--disaggregation-transfer-backend", sys.argv[1]]
    try:
        args = prepare_server_args(argv)
    except SystemExit as exc:
        print(json.dumps({"parsed": False, "exit": exc.code}))
        sys.exit(0)
    import sglang.srt.disaggregation.decode as decode
    import sglang.srt.disaggregation.prefill as prefill
    import sglang.srt.managers.disagg_service as service
    import sglang.srt.managers.scheduler as scheduler
    from sglang.srt.disaggregation import utils
    import sglang.srt.mem_cache.memory_pool as pools
    def ours(fn):  # a HookRegistry wrapper around a kvtransport hook
        cells = [c.cell_contents for c in (getattr(fn, "__closure__", None) or ())]
        return any(getattr(c, "__module__", "").startswith("kvtransport.") for c in cells)
    backend = utils.TransferBackend(args.disaggregation_transfer_backend)
    kinds = {k.name: utils.get_kv_class(backend, k) for k in utils.KVClassType}
    print(json.dumps({
        "parsed": True,
        "backend": backend.name,
        "classes": {k: (f"{v.__module__}.{v.__qualname__}" if v else None) for k, v in kinds.items()},
        # every module that imported the enum or the resolver by name sees the plugin's
        "enum_everywhere": all(m.TransferBackend is utils.TransferBackend for m in (scheduler, service)),
        "resolver_everywhere": all(m.get_kv_class is utils.get_kv_class for m in (prefill, decode)),
        "mooncake": utils.TransferBackend("mooncake").name,
        # KVTRANSPORT_LAYERWISE: what wraps the prefill forward and the pools' KV writes
        "wrapped": sorted(
            f"{owner.__name__}.{name}"
            for owner, name in [
                (scheduler.Scheduler, "run_batch"),
                (pools.MHATokenToKVPool, "set_kv_buffer"),
                (pools.MLATokenToKVPool, "set_kv_buffer"),
                (pools.MLATokenToKVPool, "set_mla_kv_buffer"),
            ]
            if ours(getattr(owner, name))
        ),
        "others": sorted(m.value for m in utils.TransferBackend),
    }))
    """
)


def run_sglang(backend: str, **env: str) -> dict[str, object]:
    """What the child found in a fresh SGLang process (seconds to import): once per arguments
    in this session, since the child changes nothing the next one sees."""
    return dict(_run_sglang(backend, tuple(sorted(env.items()))))


@functools.cache
def _run_sglang(backend: str, env_items: tuple[tuple[str, str], ...]) -> dict[str, object]:
    env = dict(env_items)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("KVTRANSPORT_", "SGLANG_PLUGINS"))}
    path = os.pathsep.join(p for p in (str(STAND_INS), clean.get("PYTHONPATH", "")) if p)
    out = subprocess.run(
        [sys.executable, "-c", CHILD, backend],
        capture_output=True,
        text=True,
        timeout=240,
        env={**clean, "PYTHONPATH": path, **env},
        cwd=STAND_INS,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    doc: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return doc


def test_the_core_distribution_registers_the_plugin() -> None:
    (ep,) = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "kvtransport"]
    assert ep.value == "kvtransport.integrations.sglang_plugin:register"
    assert ep.dist is not None and ep.dist.name == "kvtransport"


def test_sglang_loads_the_plugin_and_resolves_the_backend_to_the_adapter() -> None:
    doc = run_sglang("kvtransport")
    assert doc["parsed"] and doc["backend"] == "KVTRANSPORT"
    adapter = "kvtransport.integrations.sglang."
    assert doc["classes"] == {
        "KVARGS": "sglang.srt.disaggregation.base.conn.KVArgs",
        "MANAGER": adapter + "manager.KVTransportKVManager",
        "SENDER": adapter + "sender.KVTransportKVSender",
        "RECEIVER": adapter + "receiver.KVTransportKVReceiver",
        "BOOTSTRAP_SERVER": adapter + "bootstrap_server.KVTransportKVBootstrapServer",
    }
    assert doc["enum_everywhere"] and doc["resolver_everywhere"]
    # SGLang's own backends are untouched.
    assert doc["mooncake"] == "MOONCAKE"
    assert {"mooncake", "nixl", "fake", "kvtransport"} <= set(doc["others"])  # type: ignore[arg-type]


def test_the_layerwise_hooks_are_installed_only_with_the_flag() -> None:
    """KVTRANSPORT_LAYERWISE=1: SGLang's HookRegistry wraps the prefill forward and the pools'
    KV writes with kvtransport's hooks; without it SGLang's forward runs untouched."""
    assert run_sglang("kvtransport")["wrapped"] == []
    assert run_sglang("kvtransport", KVTRANSPORT_LAYERWISE="1")["wrapped"] == [
        "MHATokenToKVPool.set_kv_buffer",
        "MLATokenToKVPool.set_kv_buffer",
        "MLATokenToKVPool.set_mla_kv_buffer",
        "Scheduler.run_batch",
    ]


def test_sglang_refuses_the_prefill_complete_allocation_policy_for_this_backend(tmp_path: Path) -> None:
    """--disaggregation-decode-allocation-policy prefill_complete: SGLang's own resolution of the
    arguments (pd_disaggregation_hook, _validate_prefill_complete, run by ServerArgs.resolve_once
    before any scheduler starts) refuses it for every backend but Mooncake, naming the flag; the
    manager refuses it too where that check was skipped (test_sglang)."""
    model = tmp_path / "tiny-llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    child = textwrap.dedent(
        """
        import json, sys
        from sglang.srt.plugins import load_plugins
        load_plugins()
        from sglang.srt.server_args import prepare_server_args
        args = prepare_server_args(["--model-path", sys.argv[1], "--device", "cpu", "--skip-tokenizer-init",
                                    "--disaggregation-mode", "decode", "--disaggregation-transfer-backend", sys.argv[2],
                                    "--disaggregation-decode-allocation-policy", "prefill_complete"])
        try:
            args.resolve_once()
            print(json.dumps({"error": None}))
        except ValueError as exc:
            print(json.dumps({"error": str(exc)}))
        """
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("KVTRANSPORT_", "SGLANG_PLUGINS"))}
    path = os.pathsep.join(p for p in (str(STAND_INS), clean.get("PYTHONPATH", "")) if p)
    errors = {}
    for backend in ("kvtransport", "mooncake"):
        out = subprocess.run(
            [sys.executable, "-c", child, str(model), backend],
            capture_output=True,
            text=True,
            timeout=240,
            env={**clean, "PYTHONPATH": path},
            cwd=STAND_INS,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        errors[backend] = json.loads(out.stdout.strip().splitlines()[-1])["error"]
    assert errors["mooncake"] is None  # the control: the policy is SGLang's, for Mooncake
    assert "--disaggregation-decode-allocation-policy prefill_complete" in str(errors["kvtransport"])
    assert "transfer backends other than Mooncake" in str(errors["kvtransport"])


def test_without_the_plugin_sglang_refuses_the_backend_name() -> None:
    """The control: SGLang's whitelist of plugins excludes kvtransport, and the same command
    line fails in SGLang's parser (so it is the plugin that enables the backend)."""
    doc = run_sglang("kvtransport", SGLANG_PLUGINS="someone-else")
    assert doc == {"parsed": False, "exit": 2}
