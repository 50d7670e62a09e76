"""SGLang transfer backend: the four classes SGLang's disaggregation scheduler drives, built on
kvtransport's endpoint, so that any kvtransport driver (negotiated per peer pair) moves SGLang's
KV cache.

Written against SGLang 0.5.23's ``sglang.srt.disaggregation.base.conn``. SGLang finds these
classes through kvtransport's plugin (:mod:`kvtransport.integrations.sglang_plugin`): no patch.
What SGLang's scheduler expects of them, call by call: docs/sglang-contract.md.

This package owns the backend, one module per role, and re-exports their public names here:

- :mod:`~kvtransport.integrations.sglang.common`: what every role shares (SGLang's base
  classes, the timeouts, a room's transfer tag, the TP sizes that pair, :class:`KVTransferError`
  and a request's failure, the rank's KV description read from ``KVArgs``);
- :mod:`~kvtransport.integrations.sglang.manager`: :class:`KVTransportKVManager`, one per rank;
- :mod:`~kvtransport.integrations.sglang.sender`: :class:`KVTransportKVSender`, prefill's side
  of one request;
- :mod:`~kvtransport.integrations.sglang.receiver`: :class:`KVTransportKVReceiver`, decode's
  side of one request;
- :mod:`~kvtransport.integrations.sglang.bootstrap_server`:
  :class:`KVTransportKVBootstrapServer`, the instance's registry of prefill rank endpoints.

How the pieces map:

- one :class:`KVTransportKVManager` per rank opens one :class:`~kvtransport.runtime.endpoint.Endpoint`
  over the rank's ``KVArgs`` (one item = one page of one buffer; aux slots; one state group
  per ``state_types`` entry: the SWA window pool, the Mamba slots);
- prefill ranks register their endpoint address with the :class:`KVTransportKVBootstrapServer`
  of their instance; a decode rank's receiver looks its prefill peer up there (same TP rank and
  the prefill DP rank it was given), connects once per peer and reuses the connection;
- a request's bootstrap room is the transfer tag: the decode receiver announces the pages
  (``send_metadata``), the prefill sender finds the connection that announced its room and
  writes each chunk as the scheduler hands it over, the aux slot and the state items (SWA
  window pages, the Mamba slot) with the last chunk;
- ``poll`` returns kvtransport's state, whose values are SGLang's ``KVPoll``; on failure
  ``failure_exception`` raises :class:`KVTransferError` with the typed reason (peer lost,
  abort, timeout, layout mismatch).
"""

from kvtransport.integrations.pairing import tp_pairing_problem as tp_pairing_problem
from kvtransport.integrations.sglang.bootstrap_server import KVTransportKVBootstrapServer
from kvtransport.integrations.sglang.common import SERVED_STATE_TYPES as SERVED_STATE_TYPES
from kvtransport.integrations.sglang.common import SGLANG_TIMEOUTS as SGLANG_TIMEOUTS
from kvtransport.integrations.sglang.common import SGLANG_VERSION as SGLANG_VERSION
from kvtransport.integrations.sglang.common import KVTransferError
from kvtransport.integrations.sglang.common import kv_memory as kv_memory
from kvtransport.integrations.sglang.common import regions_of as regions_of
from kvtransport.integrations.sglang.common import room_tag as room_tag
from kvtransport.integrations.sglang.common import sglang_timeouts as sglang_timeouts
from kvtransport.integrations.sglang.common import state_types_of as state_types_of
from kvtransport.integrations.sglang.common import unserved_parallelism as unserved_parallelism
from kvtransport.integrations.sglang.manager import CONNECT_WORKERS as CONNECT_WORKERS
from kvtransport.integrations.sglang.manager import MAX_HELD_ROOMS as MAX_HELD_ROOMS
from kvtransport.integrations.sglang.manager import MAX_PENDING_PUBLISH as MAX_PENDING_PUBLISH
from kvtransport.integrations.sglang.manager import MAX_PREFILL_PEERS as MAX_PREFILL_PEERS
from kvtransport.integrations.sglang.manager import PARALLEL_INFO_LOOKUP_S as PARALLEL_INFO_LOOKUP_S
from kvtransport.integrations.sglang.manager import PUBLISH_TIMEOUT_S as PUBLISH_TIMEOUT_S
from kvtransport.integrations.sglang.manager import QUERY_WORKERS as QUERY_WORKERS
from kvtransport.integrations.sglang.manager import REGISTER_FIRST_WAIT_S as REGISTER_FIRST_WAIT_S
from kvtransport.integrations.sglang.manager import ROUTE_LOOKUP_S as ROUTE_LOOKUP_S
from kvtransport.integrations.sglang.manager import KVTransportKVManager
from kvtransport.integrations.sglang.manager import PrefillInfo as PrefillInfo
from kvtransport.integrations.sglang.receiver import KVTransportKVReceiver
from kvtransport.integrations.sglang.sender import KVTransportKVSender

# What ``import *`` gives: the classes SGLang loads and the error it sees. The helpers and
# settings above are re-exported by name (``X as X``) for the tests and tools that read them; a
# setting is changed (monkeypatched) in the module that reads it, not here.
__all__ = [
    "KVTransferError",
    "KVTransportKVBootstrapServer",
    "KVTransportKVManager",
    "KVTransportKVReceiver",
    "KVTransportKVSender",
]
