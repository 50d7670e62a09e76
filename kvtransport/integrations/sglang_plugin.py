"""SGLang's plugin for kvtransport: ``--disaggregation-transfer-backend kvtransport`` with no
change to SGLang's files.

SGLang (0.5.23 and later) runs every function registered in the ``sglang.srt.plugins``
entry-point group (:func:`sglang.srt.plugins.load_plugins`, early in every process it starts:
the launcher before it parses arguments, the engine, schedulers, workers), then applies the
hooks they registered with its ``HookRegistry``. The core distribution registers
:func:`register` there. It

- adds ``kvtransport`` to the ``--disaggregation-transfer-backend`` choices;
- replaces the closed ``TransferBackend`` enum with one that has every member SGLang defines
  plus ``KVTRANSPORT`` (a class REPLACE hook, which SGLang propagates to every module that
  imported the enum by name);
- wraps ``get_kv_class`` so that backend resolves to :mod:`kvtransport.integrations.sglang`'s
  manager, sender, receiver and bootstrap server (every other backend is untouched);
- with ``KVTRANSPORT_LAYERWISE=1`` only, wraps ``Scheduler.run_batch`` and the KV pools'
  writes so that prefill chunks leave layer by layer
  (:mod:`kvtransport.integrations.sglang.layerwise`; without the flag SGLang's forward runs
  untouched).

Nothing here imports SGLang until SGLang calls :func:`register`; importing this module never
fails. ``SGLANG_PLUGINS``, when set, must name ``kvtransport`` for the plugin to load.
"""

from __future__ import annotations

import enum
import logging
from typing import Any

from kvtransport.spi.env import env_flag

log = logging.getLogger(__name__)

BACKEND = "kvtransport"
_UTILS = "sglang.srt.disaggregation.utils"
#: kvtransport.integrations.sglang.layerwise.ENV_LAYERWISE, named: importing that module here
#: would import SGLang's disaggregation classes in every process SGLang starts.
LAYERWISE_ENV = "KVTRANSPORT_LAYERWISE"


def register() -> None:
    """The entry point SGLang calls. Idempotent (SGLang guards it too)."""
    from sglang.srt.arg_groups import choices
    from sglang.srt.disaggregation import utils
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND not in choices.DISAGG_TRANSFER_BACKEND_CHOICES:
        choices.add_disagg_transfer_backend_choices([BACKEND])
    original: type[enum.Enum] = utils.TransferBackend
    if any(member.value == BACKEND for member in original):
        return  # already extended (this process loaded the plugin before)
    extended = enum.Enum(  # type: ignore[misc]
        original.__name__,
        [(m.name, m.value) for m in original] + [(BACKEND.upper(), BACKEND)],
        module=original.__module__,
        qualname=original.__qualname__,
    )
    HookRegistry.register(f"{_UTILS}.TransferBackend", extended, HookType.REPLACE)
    HookRegistry.register(f"{_UTILS}.get_kv_class", _get_kv_class, HookType.AROUND)
    if env_flag(LAYERWISE_ENV, False):
        from kvtransport.integrations.sglang.layerwise import register_hooks

        register_hooks(HookRegistry, HookType)
    log.debug("kvtransport registered as SGLang transfer backend %r", BACKEND)


def _get_kv_class(original: Any, *args: Any, **kwargs: Any) -> Any:
    """``get_kv_class(transfer_backend, class_type)`` with the kvtransport backend resolved;
    everything else goes to SGLang's own."""
    transfer_backend = args[0] if args else kwargs.get("transfer_backend")
    class_type = args[1] if len(args) > 1 else kwargs.get("class_type")
    if getattr(transfer_backend, "value", transfer_backend) != BACKEND:
        return original(*args, **kwargs)
    from sglang.srt.disaggregation.utils import KVClassType

    if class_type == KVClassType.KVARGS:
        return original(*args, **kwargs)  # SGLang's own container, as for its own backends
    from kvtransport.integrations.sglang import (
        KVTransportKVBootstrapServer,
        KVTransportKVManager,
        KVTransportKVReceiver,
        KVTransportKVSender,
    )

    return {
        KVClassType.MANAGER: KVTransportKVManager,
        KVClassType.SENDER: KVTransportKVSender,
        KVClassType.RECEIVER: KVTransportKVReceiver,
        KVClassType.BOOTSTRAP_SERVER: KVTransportKVBootstrapServer,
    }.get(class_type)
