"""Layer-wise sends, the part that decides without doing: which KV regions hold which layer, and
when the layers a sender marked ready go out as a group.

A layer-wise send (``runtime.layerwise``) posts a request's pages one *layer group* at a time,
as prefill finishes computing them. This module owns the two pure decisions behind it:

- :func:`region_layers`: the layer of each KV region. SGLang registers every layer's K buffer,
  then every layer's V buffer (``kv_split="kv"``: ``2 * num_layers`` regions); MLA and fused
  layouts register one buffer per layer. Anything else must be stated by the caller.
- :class:`Grouper`: given the layers marked ready so far, which go out now. Short requests
  (under ``LayerwisePolicy.min_tokens``) go in one batch once every layer is ready: below that
  length a batch per group costs more in fixed per-batch overhead than the overlap saves.
  Longer ones start with small groups (the first layer leaves as soon as it is computed) and
  merge when posting falls behind: when the groups posted before are still in flight as the
  next is due (the link, not the compute, is the bottleneck, and fewer, larger batches move
  the same bytes with less overhead), or when posting a group took a sizable share of the
  time between two marks (the caller's thread, which computes, pays for it).

Nothing here does I/O or reads a clock: the stream passes in what it measured.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import ClassVar

from kvtransport.spi.env import env_flag, env_int
from kvtransport.spi.errors import ConfigError
from kvtransport.spi.memory import KVLayout, RegionSet

#: Below this many tokens a request goes in one batch (measured: docs/layerwise.md).
DEFAULT_MIN_TOKENS = 128
#: A group is merged with the next when posting it took more than this share of the time
#: between two layers' marks.
POST_SHARE = 0.25
#: ... or when this many of the stream's earlier batches are still in flight as it is due.
BACKLOG = 2


@dataclass(frozen=True)
class LayerwisePolicy:
    """How a layer-wise send groups layers (each has an environment variable, ``ENV``).

    ``min_tokens``: requests shorter than this go in one batch once every layer is ready.
    ``first_group``: layers in the first group. ``max_group``: most layers in one group (0:
    all of them). ``adaptive``: merge groups when posting falls behind (module docstring); off,
    every group has ``first_group`` layers."""

    min_tokens: int = DEFAULT_MIN_TOKENS
    first_group: int = 1
    max_group: int = 0
    adaptive: bool = True

    ENV: ClassVar[dict[str, str]] = {
        "min_tokens": "KVTRANSPORT_LAYERWISE_MIN_TOKENS",
        "first_group": "KVTRANSPORT_LAYERWISE_GROUP",
        "max_group": "KVTRANSPORT_LAYERWISE_MAX_GROUP",
        "adaptive": "KVTRANSPORT_LAYERWISE_ADAPTIVE",
    }

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "adaptive":
                if not isinstance(value, bool):
                    raise ConfigError(f"layer-wise policy: adaptive={value!r} must be True or False")
                continue
            least = 1 if f.name == "first_group" else 0
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ConfigError(f"layer-wise policy: {f.name}={value!r} must be a whole number of at least {least}")
        if self.max_group and self.max_group < self.first_group:
            raise ConfigError(f"layer-wise policy: max_group={self.max_group} is below first_group={self.first_group}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> LayerwisePolicy:
        d = cls()
        return cls(
            min_tokens=env_int(cls.ENV["min_tokens"], d.min_tokens, env, zero=True),
            first_group=env_int(cls.ENV["first_group"], d.first_group, env),
            max_group=env_int(cls.ENV["max_group"], d.max_group, env, zero=True),
            adaptive=env_flag(cls.ENV["adaptive"], d.adaptive, env),
        )


#: Every variable this module reads (the catalogue in ``runtime.environment`` knows them).
ENV_VARS: tuple[str, ...] = tuple(LayerwisePolicy.ENV.values())


def region_layers(layout: KVLayout, regions: RegionSet, stated: Sequence[int] | None = None) -> tuple[int, ...]:
    """The layer of each KV region of ``regions`` (``stated``: the caller's, checked). Every
    layer in ``range(layout.num_layers)`` must own at least one region, or a send by layers
    would never move some of the pages' bytes."""
    n, count = layout.num_layers, len(regions.kv)
    if stated is not None:
        layers = tuple(int(x) for x in stated)
        if len(layers) != count:
            raise ConfigError(f"region_layers names {len(layers)} layers for {count} KV regions; one per region")
    elif count == n:
        layers = tuple(range(n))  # one buffer per layer (MLA's latent, or K and V fused)
    elif count == 2 * n:
        layers = tuple(i % n for i in range(count))  # every K buffer, then every V buffer (SGLang)
    else:
        raise ConfigError(
            f"cannot tell which of the {count} KV regions hold which of the layout's {n} layers "
            "(known: one region per layer, or every layer's K then every layer's V); pass region_layers"
        )
    if any(not 0 <= x < n for x in layers):
        raise ConfigError(f"region_layers names layers outside [0, {n}): {sorted(set(layers))[:8]}")
    if len(set(layers)) != n:
        missing = sorted(set(range(n)) - set(layers))
        raise ConfigError(f"region_layers leaves layers {missing[:8]} without a region")
    return layers


def regions_by_layer(layers: Sequence[int], num_layers: int) -> tuple[tuple[int, ...], ...]:
    """The KV regions of each layer, from the layer of each region (``region_layers``)."""
    out: list[list[int]] = [[] for _ in range(num_layers)]
    for region, layer in enumerate(layers):
        out[layer].append(region)
    return tuple(tuple(r) for r in out)


class Grouper:
    """The grouping of one layer-wise send of ``tokens`` tokens over ``num_layers`` layers
    (module docstring). Not thread-safe: its stream calls it under its own lock."""

    def __init__(self, num_layers: int, tokens: int, policy: LayerwisePolicy) -> None:
        if num_layers < 1:
            raise ConfigError(f"a layer-wise send needs at least one layer, not {num_layers}")
        self.num_layers = num_layers
        self.policy = policy
        #: Below the minimum length: one group of every layer, once all are ready.
        self.whole = tokens < policy.min_tokens
        self.size = num_layers if self.whole else min(policy.first_group, num_layers)
        self.max_size = num_layers if not policy.max_group else min(policy.max_group, num_layers)
        self.ready: set[int] = set()
        self.pending: list[int] = []
        self.posted: list[tuple[int, ...]] = []

    @property
    def complete(self) -> bool:
        """Every layer was posted in some group."""
        return len(self.ready) == self.num_layers and not self.pending

    def check_layer(self, layer: int) -> None:
        """:class:`ConfigError` unless ``layer`` is one of this send's layers."""
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < self.num_layers:
            raise ConfigError(f"layer {layer!r} is not one of this send's layers [0, {self.num_layers})")

    def mark(self, layer: int, *, backlog: int = 0, post_share: float = 0.0) -> tuple[int, ...] | None:
        """Layer ``layer`` is ready; the group to post now, if one is due. ``backlog``: the
        stream's batches still in flight; ``post_share``: the last group's posting time over the
        time between two marks (both 0 when unknown)."""
        self.check_layer(layer)
        if layer in self.ready:
            raise ConfigError(f"layer {layer} was already marked ready")
        self.ready.add(layer)
        self.pending.append(layer)
        if self.policy.adaptive and not self.whole and (backlog >= BACKLOG or post_share > POST_SHARE):
            self.size = min(self.size * 2, self.max_size)
        if len(self.pending) < self.size and len(self.ready) < self.num_layers:
            return None
        group, self.pending = tuple(self.pending), []
        self.posted.append(group)
        return group
