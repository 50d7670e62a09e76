"""The handshake's documents as typed, bounded schemas: the hello (every part), a driver's cost
models, the regions a peer registers, and the decision an acceptor sends back.

One :class:`msgspec.Struct` per part is the one place its fields are typed and bounded; the
tables of docs/hello.md and docs/wire.md are rendered from them (``kvtransport.tools.schema_doc``).
:func:`parse` reads a document (JSON-decoded or from a control message) strictly: no coercion (no
string or float for an integer, no ``true`` for a number), every bound checked, and an unknown
field refused (the protocol version is the whole compatibility rule: a field added changes the
version), except at the hello's top level, where a reader ignores what it does not know (``doctor
--json`` adds ``diagnostics``). Any violation is a :class:`~kvtransport.spi.errors.ProtocolError`
naming the field by its path (``hello.layout.tp_rank``). The conversion to the model
(:class:`~kvtransport.negotiation.hello.Hello`, :class:`~kvtransport.spi.memory.RegionSet`) is
its owner's.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta, Struct

from kvtransport.spi.errors import ProtocolError
from kvtransport.spi.memory import MAX_ADDRESS, MAX_STATE_GROUPS

#: Most regions a peer may describe (a 128-layer model with K and V, aux and state buffers).
MAX_REGIONS = 4096
#: Most drivers a hello may list (parsing is linear in it, on the I/O thread).
MAX_DRIVERS = 64
#: Longest endpoint label (an endpoint's name: it ends up in logs and error messages).
MAX_ENDPOINT_LABEL = 256
#: Longest free text (reasons, notes); a side cuts its own longer ones when it builds a hello.
MAX_NOTE = 4096
#: Ranges a cost model's figures must fall in (a peer's hello cannot make a prediction
#: overflow, go negative or come out NaN).
MAX_LATENCY_S = 10.0
MAX_PER_RUN_S = 0.1
MIN_GBPS, MAX_GBPS = 1e-4, 1e5
#: At most this many cost models per driver in one hello (one per path it was calibrated on).
MAX_MODELS_PER_DRIVER = 16
MAX_TEXT = 128
#: Bounds of the KV layout's counts: far beyond any model, small enough that nothing computed
#: from them (head slices, page geometry) gets large.
MAX_LAYERS = 1 << 16
MAX_HEADS = 1 << 16
MAX_PAGE_TOKENS = 1 << 24
MAX_TP = 1 << 16
#: Every byte count (page and item sizes, region lengths) fits in a signed 62-bit number.
MAX_INT = (1 << 62) - 1
#: Bound of a decision's figures (GB/s, seconds).
MAX_FIGURE = 1e9

Name = Annotated[str, Meta(max_length=64)]
Text = Annotated[str, Meta(max_length=MAX_TEXT)]
Note = Annotated[str, Meta(max_length=MAX_NOTE)]
Label = Annotated[str, Meta(max_length=MAX_ENDPOINT_LABEL)]
#: A memory kind: ``host`` (or ``cpu``) or ``cuda:N``.
MemoryText = Annotated[str, Meta(pattern=r"^(host|cpu|cuda:[0-9]{1,4})$")]
#: A memory family, as drivers declare what they read and write.
Family = Annotated[str, Meta(max_length=16)]
ByteCount = Annotated[int, Meta(ge=0, le=MAX_INT)]
#: Standard base64 with padding (a driver's connection info; bounded by the message size limit).
Base64 = Annotated[str, Meta(pattern=r"^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$")]


def about(text: str) -> Meta:
    """A field's description: what docs/hello.md and docs/wire.md say of it."""
    return Meta(description=text)


class Part(Struct, forbid_unknown_fields=True, kw_only=True):
    """A part of a document: exactly its fields."""


# --- the hello ------------------------------------------------------------------------------------


class ProtocolDoc(Part, kw_only=True):
    """Which protocol, which version, and the sender's label."""

    name: Literal["kvtransport"]
    version: Annotated[
        int, Meta(ge=0, le=1 << 16), about("must equal the reader's protocol version; the older side must upgrade")
    ]
    endpoint: Annotated[Label, about('a label for messages ("host:pid" by default)')] = ""


class CudaDeviceDoc(Part, kw_only=True):
    """One CUDA device."""

    index: Annotated[int, Meta(ge=0, le=9999)]
    uuid: Text = ""
    pci_bus_id: Text = ""
    name: Text = ""
    gdr: Annotated[bool | None, about("GPUDirect RDMA: `null` is unknown, `gdr_reason` says why")] = None
    gdr_reason: Note = ""


class HostDoc(Part, kw_only=True):
    """What the host can do (spi.probe.HostInfo)."""

    host_id: Annotated[Name, about("equal for all processes of one host during one boot")]
    hostname: Annotated[str, Meta(max_length=255)] = ""
    cuda_devices: Annotated[list[CudaDeviceDoc], Meta(max_length=256)] = []
    cuda_note: Annotated[Note, about("why no CUDA device is listed, if none is")] = ""
    rdma_devices: Annotated[list[Name], Meta(max_length=256)] = []
    rdma_note: Note = ""
    peermem: Annotated[bool, about("`nvidia_peermem` (or `nv_peer_mem`) is loaded")] = False
    versions: Annotated[
        dict[Text, Text], Meta(max_length=64), about("distribution -> version: kvtransport and the engines")
    ] = {}


class CapabilitiesDoc(Part, kw_only=True):
    """What the driver class declares (docs/writing-a-driver.md)."""

    reads: Annotated[list[Family], Meta(max_length=8), about("memory families it reads from (`host`, `cuda`)")]
    writes: Annotated[list[Family], Meta(max_length=8), about("memory families it writes into")]
    same_host_only: bool = False
    two_sided: bool = False
    gathers: bool = False


class StatusDoc(Part, kw_only=True):
    """The driver's probe on this host."""

    available: bool
    reason: Note = ""
    fix: Note = ""
    version: Text = ""
    memory: Annotated[
        list[Family], Meta(max_length=8), about("memory families this host serves through the driver (`host`, `cuda`)")
    ] = []
    memory_notes: Annotated[dict[Family, Note], Meta(max_length=8), about("why a family is missing")] = {}
    info: Annotated[
        dict[Name, Note],
        Meta(max_length=32),
        about("flat strings the driver's `offer` reads on both sides (e.g. Mooncake `protocol`)"),
    ] = {}


class CostModelDoc(Part, kw_only=True):
    """A measured cost model (`kvtransport calibrate`), per path and far host."""

    path: Text = ""
    latency_s: Annotated[float, Meta(ge=0.0, le=MAX_LATENCY_S), about("seconds of fixed latency per batch")]
    per_run_s: Annotated[float, Meta(ge=0.0, le=MAX_PER_RUN_S), about("seconds per descriptor")]
    gbps: Annotated[float, Meta(ge=MIN_GBPS, le=MAX_GBPS)]
    peer_host: Annotated[Text, about("the far host's `host_id` (this host's own for loopback)")] = ""
    version: Annotated[Text, about("the driver version it was measured with")] = ""
    measured_at: Annotated[float, Meta(ge=0.0, le=1e11), about("unix time")]
    memory: Annotated[Text, about("the KV memory family it was measured on")] = "host"


class DriverDoc(Part, kw_only=True):
    """One installed driver as a side reports it (`drivers.<name>`, the name at most 64 characters)."""

    distribution: Label = ""
    api_version: Annotated[int, Meta(ge=0, le=1 << 16), about("the driver API it was built for")] = 0
    capabilities: Annotated[
        CapabilitiesDoc | None, about("`null` together with `status`: a driver that failed to load")
    ] = None
    status: Annotated[StatusDoc | None, about("`null` when the driver failed to load; `load_error` says why")] = None
    load_error: Note = ""
    conn: Annotated[Base64, about("base64 of the driver's connection info (empty in a `doctor` report)")] = ""
    costs: Annotated[
        list[CostModelDoc],
        Meta(max_length=MAX_MODELS_PER_DRIVER),
        about("the driver's measured cost models on this host; empty (or absent): not calibrated"),
    ] = []

    def __post_init__(self) -> None:
        if (self.capabilities is None) != (self.status is None):
            # A loaded driver states both: the negotiation reads the capabilities (same host
            # only, two-sided) of a driver whose status says it is usable.
            raise ValueError("capabilities and status must both be null (failed to load) or both be given")


#: A value of ``layout.extra``: what an engine states about its pool.
ExtraValue = (
    Annotated[str, Meta(max_length=256)]
    | Annotated[int, Meta(ge=-MAX_INT, le=MAX_INT)]
    | bool
    | None
    | Annotated[dict[Name, Annotated[int, Meta(ge=-MAX_INT, le=MAX_INT)]], Meta(max_length=16)]
)


class LayoutDoc(Part, kw_only=True):
    """The KV layout (spi.memory.KVLayout). Two layouts are compatible when everything but
    `tp_rank` and `memory` is equal, or, with different TP sizes that divide one another, when
    the pages are what each rank's share of `total_kv_heads` makes them (MHA) or equal (MLA)."""

    page_size: Annotated[int, Meta(ge=1, le=MAX_PAGE_TOKENS), about("tokens per page")]
    dtype: Name
    num_layers: Annotated[int, Meta(ge=0, le=MAX_LAYERS)]
    kv_item_lens: Annotated[
        list[Annotated[int, Meta(ge=1, le=MAX_INT)]],
        Meta(max_length=MAX_REGIONS),
        about("bytes of one page of each KV region, in region order"),
    ]
    memory: Annotated[MemoryText, about("where the KV lives (`host`, `cuda:N`)")] = "host"
    kv_split: Annotated[Literal["kv", "mla"], about("`kv`: separate K and V buffers; `mla`: one latent buffer")] = "kv"
    num_kv_heads: Annotated[int, Meta(ge=0, le=MAX_HEADS), about("0: not stated")] = 0
    head_dim: Annotated[int, Meta(ge=0, le=MAX_HEADS), about("0: not stated")] = 0
    tp_rank: Annotated[int, Meta(ge=0, le=MAX_TP), about("below `tp_size`")] = 0
    tp_size: Annotated[int, Meta(ge=1, le=MAX_TP)] = 1
    total_kv_heads: Annotated[
        int,
        Meta(ge=0, le=MAX_HEADS),
        about(
            "the model's KV heads over all ranks (0: not stated); with different TP sizes the heads each pair "
            "moves follow from them ([architecture.md](architecture.md#unequal-tensor-parallelism))"
        ),
    ] = 0
    aux_item_lens: Annotated[list[ByteCount], Meta(max_length=MAX_REGIONS)] = []
    state_types: Annotated[
        list[Name],
        Meta(max_length=MAX_STATE_GROUPS),
        about("per state group, what it holds (the application's name: SGLang's `swa`, `mamba`)"),
    ] = []
    state_item_lens: Annotated[
        list[Annotated[list[ByteCount], Meta(max_length=MAX_REGIONS)]],
        Meta(max_length=MAX_STATE_GROUPS),
        about("per state group, the bytes of one item of each of its buffers; equal on both sides"),
    ] = []
    extra: Annotated[
        dict[Name, ExtraValue],
        Meta(max_length=32),
        about("what the engine states about its pool (`engine`, `role`, `block_size`, `aux_rows`...)"),
    ] = {}

    def __post_init__(self) -> None:
        if self.tp_rank >= self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is not below tp_size {self.tp_size}")


class PolicyDoc(Part, kw_only=True):
    """The sender's `KVTRANSPORT_DRIVER` / `_DRIVERS` / `_EXCLUDE` / `_FAILOVER`."""

    force: Name | None = None
    allow: Annotated[list[Name], Meta(max_length=MAX_DRIVERS)] = []
    exclude: Annotated[list[Name], Meta(max_length=MAX_DRIVERS)] = []
    failover: Annotated[
        Literal["auto", "on", "off"], about("a standby driver: between hosts (`auto`), always, never")
    ] = "auto"


class HelloDoc(Struct, kw_only=True):
    """A hello. Unknown keys at this level are ignored (`doctor --json` adds `diagnostics`);
    everywhere below, an unknown key is a `ProtocolError`."""

    protocol: ProtocolDoc
    host: HostDoc
    drivers: Annotated[dict[Name, DriverDoc], Meta(max_length=MAX_DRIVERS)]
    layout: Annotated[
        LayoutDoc | None, about("`null` in a bare host report (read as host-memory KV); required in a handshake")
    ] = None
    policy: PolicyDoc = msgspec.field(default_factory=PolicyDoc)


# --- the regions and the decision -----------------------------------------------------------------


class RegionDoc(Part, kw_only=True):
    """One registered buffer (spi.memory.Region)."""

    ptr: Annotated[int, Meta(ge=1, le=MAX_ADDRESS - 1), about("the region ends before 2**63")]
    length: Annotated[int, Meta(ge=1, le=MAX_ADDRESS - 1)]
    kind: MemoryText
    item_len: Annotated[int, Meta(ge=1, le=MAX_ADDRESS - 1), about("divides `length`")]
    name: Annotated[str, Meta(max_length=256)] = ""


class RegionsDoc(Part, kw_only=True):
    """The regions an endpoint registers (at most 4,096 in all; none overlapping)."""

    kv: Annotated[list[RegionDoc], Meta(max_length=MAX_REGIONS)]
    aux: Annotated[list[RegionDoc], Meta(max_length=MAX_REGIONS)] = []
    state: Annotated[list[RegionDoc], Meta(max_length=MAX_REGIONS)] = []
    state_groups: Annotated[
        list[Annotated[int, Meta(ge=0, le=MAX_REGIONS)]],
        Meta(max_length=MAX_STATE_GROUPS),
        about("how many consecutive `state` regions each state group has"),
    ] = []

    def __post_init__(self) -> None:
        if len(self.kv) + len(self.aux) + len(self.state) > MAX_REGIONS:
            raise ValueError(f"more than {MAX_REGIONS} regions")


class CandidateDoc(Part, kw_only=True):
    """One driver's fate in the decision."""

    driver: Name
    outcome: Annotated[Name, about("`chosen`, `lost` or `rejected`")]
    reason: Note
    path: Name = ""
    gbps: Annotated[float, Meta(ge=0.0, le=MAX_FIGURE)] = 0.0
    predicted_s: Annotated[float, Meta(ge=0.0, le=MAX_FIGURE)] = 0.0


class DecisionDoc(Part, kw_only=True):
    """The acceptor's decision; the initiator's own must have the same `driver`, `path`, `lanes` and `standby`."""

    driver: Name
    path: Name
    gbps: Annotated[float, Meta(ge=0.0, le=MAX_FIGURE)]
    reason: Note
    basis: Annotated[Name, about("`calibrated` or `nominal`")] = "nominal"
    basis_note: Note = ""
    lanes: Annotated[
        list[Name], Meta(max_length=MAX_DRIVERS), about("the drivers a transfer may take, `driver` first")
    ] = []
    standby: Annotated[list[Name], Meta(max_length=MAX_DRIVERS), about("the lanes kept only to fail over to")] = []
    initiator: Label = ""
    acceptor: Label = ""
    candidates: Annotated[list[CandidateDoc], Meta(max_length=MAX_DRIVERS)] = []


# --- reading --------------------------------------------------------------------------------------

D = TypeVar("D")


def parse(data: Any, schema: type[D], root: str) -> D:
    """``data`` (a decoded document) as ``schema``; :class:`ProtocolError` naming the field
    (from ``root``) on anything that breaks it."""
    try:
        return msgspec.convert(data, schema)
    except msgspec.ValidationError as exc:
        raise ProtocolError(schema_error(exc, root)) from None
    except (RecursionError, OverflowError, TypeError, ValueError) as exc:
        raise ProtocolError(f"{root}: {type(exc).__name__}: {str(exc)[:200]}") from None


def cut(text: str, limit: int = MAX_NOTE) -> str:
    """Free text of this side's (a reason, a note) within its field's bound."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


_AT = re.compile(r" - at `\$(.*)`$")
_WHAT = {
    "int": "an integer",
    "str": "a string",
    "bytes": "bytes",
    "array": "a list",
    "object": "a map",
    "float": "a number",
    "bool": "a boolean",
    "null": "null",
}


def schema_error(exc: msgspec.ValidationError, root: str) -> str:
    """A schema violation in words, naming the field by its path from ``root`` (``expect.aux``,
    ``hello.layout.tp_rank``), from msgspec's message (``Expected `int` >= -1 - at `$.aux```)."""
    text = str(exc)
    match = _AT.search(text)
    path, text = (root + match.group(1), text[: match.start()]) if match else (root, text)
    if m := re.fullmatch(r"Expected `(\w+)`, got `(\w+)`", text):
        return f"{path} must be {_WHAT.get(m.group(1), m.group(1))}, got {_WHAT.get(m.group(2), m.group(2))}"
    if m := re.fullmatch(r"Expected `(\w+)` (>=|<=|>|<) (\S+)", text):
        return f"{path} is outside its range: it must be {m.group(2)} {m.group(3)}"
    if m := re.fullmatch(r"Expected `(\w+)` of length (<=|>=) (\d+)", text):
        unit = {"str": "characters", "bytes": "bytes"}.get(m.group(1), "entries")
        bound = "at most" if m.group(2) == "<=" else "at least"
        return f"{path} is too {'long' if bound == 'at most' else 'short'}: {bound} {m.group(3)} {unit}"
    if m := re.fullmatch(r"Object missing required field `(.*)`", text):
        return f"{path} fields do not match its schema: {m.group(1)!r} is missing"
    if m := re.fullmatch(r"Object contains unknown field `(.*)`", text):
        return f"{path} fields do not match its schema: {m.group(1)[:64]!r} is not one of them"
    return f"{path}: {text[:300]}"
