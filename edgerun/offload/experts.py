"""Routed experts on flash: a mixture-of-experts model under a RAM budget.

Everything but the routed experts stays in RAM (attention, norms, routers, shared
experts, embeddings and head, as the planner places them); each routed expert (its
gate, up and down matrices) is read from the GGUF itself with direct I/O when a token's
router picks it, into an expert cache sized by the plan's leftover budget:

- **Reads**: the file stores each 3-D `ffn_*_exps` tensor expert after expert, so one
  expert is three contiguous ranges (gate, up, down), read together in one
  DirectReader call (spread over its threads). The GGUF is read in place, nothing is
  repacked: an expert's three ranges are each 0.9 MB at Qwen3-30B-A3B's shapes, far
  past the sizes where a read's fixed cost matters (PERF_NOTES: 1 MiB reads reach the
  device's throughput), so an expert-major copy would save no time and cost a second
  copy of the file on flash.
- **Cache**: whole experts in slots of one buffer (pages become resident as slots
  fill). A miss takes the slot whose score is lowest, score = last use (in layer
  steps) + FREQUENCY_WEIGHT * log2(1 + uses): least recently used, but an expert used
  often outlives one used once (LRU + frequency). Slots the current layer needs or a
  prefetch is filling are never taken.
- **Prefetch**: once a layer's experts are in, the routers of the next
  `prefetch_layers` layers are applied to this layer's FFN input (the residual stream
  changes little between neighbouring layers, so they predict those layers' picks
  well) and their top experts not cached are read on a background thread while this
  layer and the next compute.

Per token, ExpertStats counts the experts needed, cache hits, prefetched experts used
and wasted, bytes read and the I/O wait and compute time (`edgerun generate --stats`,
`edgerun bench`).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from edgerun.arch.spec import ATTENTION_ROLES
from edgerun.errors import InvalidArgumentError, ModelFormatError
from edgerun.model.weights import ResidentStore
from edgerun.offload.io import ALIGN, DirectReader, aligned_empty
from edgerun.ops.norm import rmsnorm
from edgerun.quant.formats import QuantTensor, QuantType, row_bytes

__all__ = [
    "EXPERT_ROLES",
    "ExpertCache",
    "ExpertLayer",
    "ExpertMatrix",
    "ExpertStats",
    "ExpertStreamStore",
    "LayerExperts",
    "StreamedExperts",
    "StreamedMoEFFN",
    "expert_layers",
]

EXPERT_ROLES = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
# An expert used often outlives one used once by this many layer steps per doubling of
# its uses (one layer step: one layer of one token).
FREQUENCY_WEIGHT = 4.0


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class ExpertMatrix:
    """One role's 3-D tensor of a layer: every expert's (rows, cols) matrix in the file
    from `offset`, `nbytes` each, one every `stride` bytes (0: back to back; a fused
    gate+up tensor holds each expert's gate and up rows together, so each part strides
    over the other)."""

    name: str
    qtype: QuantType
    shape: tuple[int, int]
    offset: int
    nbytes: int
    stride: int = 0

    def at(self, expert: int) -> int:
        """Where expert `expert`'s matrix starts in the file."""
        return self.offset + expert * (self.stride or self.nbytes)


@dataclass(frozen=True)
class ExpertLayer:
    """A layer's routed experts on flash: gate, up and down (EXPERT_ROLES order)."""

    layer: int
    n_expert: int
    matrices: tuple[ExpertMatrix, ExpertMatrix, ExpertMatrix]

    @property
    def expert_bytes(self) -> int:
        """One expert's bytes in the file (its three matrices)."""
        return sum(m.nbytes for m in self.matrices)

    def slot_bytes(self) -> int:
        """One expert's bytes in a cache slot: each matrix's block-aligned superset in
        the file (read straight into the slot with O_DIRECT, no staging copy)."""
        return sum(_align(m.nbytes) + ALIGN for m in self.matrices)

    def ranges(self, expert: int) -> list[tuple[int, int]]:
        """The file ranges (offset, length) of one expert's three matrices."""
        return [(m.at(expert), m.nbytes) for m in self.matrices]

    def aligned_ranges(self, expert: int, file_size: int) -> list[tuple[int, int, int]]:
        """(read offset, read length, where the matrix starts in what is read) of one
        expert's three matrices: each range widened to block boundaries, so a direct
        read lands in the slot as is (a range at the end of the file that cannot be
        widened is read exactly, through the reader's staging)."""
        out = []
        for off, n in self.ranges(expert):
            a0 = off - off % ALIGN
            a1 = _align(off + n)
            if a1 > file_size:
                out.append((off, n, 0))
            else:
                out.append((a0, a1 - a0, off - a0))
        return out


def expert_layers(spec, gguf, source: str) -> list[ExpertLayer]:
    """The routed experts of every layer of a GGUF that has a router (a GGUFFile: `infos`
    with offsets; a family's dense layers have none), checked against the spec's expert
    count and widths."""
    out = []
    want = {
        "ffn_gate_exps": (spec.expert_ff, spec.d_model),
        "ffn_up_exps": (spec.expert_ff, spec.d_model),
        "ffn_down_exps": (spec.d_model, spec.expert_ff),
    }
    want["ffn_gate_up_exps"] = (2 * spec.expert_ff, spec.d_model)

    def matrix(role: str, i: int) -> ExpertMatrix:
        name = spec.expert_tensor(role, i)
        info = gguf.infos.get(name)
        if info is None:
            raise ModelFormatError(f"{source}: expert tensor '{name}' is missing")
        found = tuple(reversed(info.dims))
        shape = want[role]
        if found != (spec.n_expert, *shape):
            raise ModelFormatError(
                f"{source}: expert tensor '{name}' has shape {list(found)}, expected "
                f"{[spec.n_expert, *shape]} ([n_expert, rows, cols] from the metadata)"
            )
        qtype = QuantType(info.type_id)
        nbytes = shape[0] * row_bytes(qtype, shape[1])
        return ExpertMatrix(name, qtype, shape, int(info.offset), nbytes)

    for i in range(spec.n_layers):
        if spec.expert_tensor("ffn_gate_inp", i) not in gguf.infos:
            continue  # a dense layer (model/moe.is_moe_layer)
        if spec.expert_tensor("ffn_gate_up_exps", i) in gguf.infos:
            # gate and up fused (Gemma 4): each expert's gate rows, then its up rows
            fused = matrix("ffn_gate_up_exps", i)
            half = fused.nbytes // 2
            shape = (spec.expert_ff, spec.d_model)
            mats = [
                ExpertMatrix(f"{fused.name}:gate", fused.qtype, shape, fused.offset, half,
                             fused.nbytes),
                ExpertMatrix(f"{fused.name}:up", fused.qtype, shape, fused.offset + half, half,
                             fused.nbytes),
                matrix("ffn_down_exps", i),
            ]  # fmt: skip
        else:
            mats = [matrix(role, i) for role in EXPERT_ROLES]
        out.append(ExpertLayer(i, spec.n_expert, tuple(mats)))
    return out


@dataclass
class ExpertStats:
    """Routed-expert counters since the last reset (a token's: divide by tokens)."""

    needed: int = 0  # experts a layer's rows picked, summed over layers and calls
    hits: int = 0  # of those, cached by an earlier use (cache hits)
    prefetched: int = 0  # experts a prefetch read
    prefetch_used: int = 0  # of `needed`, first used after a prefetch read them
    bytes_read: int = 0  # expert bytes read from flash (alignment padding excluded)
    io_s: float = 0.0  # compute waiting for expert reads
    compute_s: float = 0.0  # the MoE FFN's own time, less its waits
    calls: int = 0  # MoE FFN calls (layers x steps)
    tokens: int = 0  # rows the MoE FFNs ran over, divided by layers
    per_token: list[tuple[int, int, int]] = field(default_factory=list)  # (needed, hits, bytes)

    def reset(self) -> None:
        self.__init__()

    @property
    def hit_rate(self) -> float:
        """Share of the experts needed that the cache held from an earlier use."""
        return self.hits / self.needed if self.needed else float("nan")

    @property
    def ready_rate(self) -> float:
        """Share of the experts needed that needed no demand read (cached or prefetched)."""
        return (self.hits + self.prefetch_used) / self.needed if self.needed else float("nan")


class ExpertCache:
    """Slots of whole experts, keyed by (layer, expert); LRU + frequency eviction."""

    def __init__(self, capacity: int, slot_bytes: int) -> None:
        if capacity < 1:
            raise InvalidArgumentError(f"an expert cache needs >= 1 slot, got {capacity}")
        self.capacity = capacity
        self.slot_bytes = slot_bytes
        # one mapping; a slot's pages become resident when it is first filled
        self.buffer = aligned_empty(capacity * slot_bytes).reshape(capacity, slot_bytes)
        self.slot_of: dict[tuple[int, int], int] = {}
        self.key_of: list[tuple[int, int] | None] = [None] * capacity
        self.last_use = np.full(capacity, -(1 << 40), np.float64)
        self.uses = np.zeros(capacity, np.float64)
        self.clock = 0  # layer steps so far
        self.evictions = 0

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes

    def __len__(self) -> int:
        return len(self.slot_of)

    def __contains__(self, key: tuple[int, int]) -> bool:
        return key in self.slot_of

    def tick(self) -> None:
        self.clock += 1

    def touch(self, slot: int) -> None:
        self.last_use[slot] = self.clock
        self.uses[slot] += 1

    def take(self, key: tuple[int, int], protected: set[int]) -> int:
        """A slot for `key` (not cached): a free one, else the lowest-scored slot not in
        `protected`; its old key is forgotten."""
        free = len(self.slot_of) < self.capacity
        if free:
            slot = next(i for i, k in enumerate(self.key_of) if k is None)
        else:
            score = self.last_use + FREQUENCY_WEIGHT * np.log2(1.0 + self.uses)
            if protected:
                score = score.copy()
                score[list(protected)] = np.inf
            slot = int(np.argmin(score))
            if not np.isfinite(score[slot]):
                raise InvalidArgumentError(
                    f"expert cache of {self.capacity} slots: every slot is in use by this "
                    "step (the plan sizes it for at least one layer's experts)"
                )
            old = self.key_of[slot]
            del self.slot_of[old]
            self.evictions += 1
        self.slot_of[key] = slot
        self.key_of[slot] = key
        self.last_use[slot] = self.clock
        self.uses[slot] = 0
        return slot


class StreamedExperts:
    """The expert source of a model whose routed experts are on flash (see the module
    doc): `matrices(layer, experts)` returns each expert's (gate, up, down) QuantTensors
    from the cache, reading the missing ones; `prefetch(layer, experts)` starts reading
    a later layer's likely experts in the background."""

    def __init__(
        self,
        direct: DirectReader,
        layers: list[ExpertLayer],
        capacity: int,
        stats: ExpertStats | None = None,
    ) -> None:
        if not layers:
            raise InvalidArgumentError("StreamedExperts needs at least one layer of experts")
        self.direct = direct
        self.layers = {ly.layer: ly for ly in layers}
        slot = max(ly.slot_bytes() for ly in layers)
        self.cache = ExpertCache(capacity, slot)
        self.stats = stats if stats is not None else ExpertStats()
        self._pending: dict[int, Future] = {}  # slot -> its prefetch read
        self._prefetched: set[int] = set()  # slots filled by a prefetch, not yet used
        self._in_use: set[int] = set()  # slots of the layer being computed
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    # -- views -------------------------------------------------------------------------
    def _views(self, layer: ExpertLayer, expert: int, slot: int) -> tuple[QuantTensor, ...]:
        buf = self.cache.buffer[slot]
        out, at = [], 0
        reads = layer.aligned_ranges(expert, self.direct.size)
        for m, (_, _, pad) in zip(layer.matrices, reads, strict=True):
            data = buf[at + pad : at + pad + m.nbytes].reshape(m.shape[0], -1)
            out.append(QuantTensor(m.name, m.qtype, m.shape, data))
            at += _align(m.nbytes) + ALIGN
        return tuple(out)

    def _reads(self, layer: ExpertLayer, expert: int, slot: int):
        """(ranges, output offsets into the cache buffer) of one expert into its slot:
        block-aligned ranges into block-aligned places, so O_DIRECT reads them straight
        in (an unaligned range would be staged and copied: ~190 MB of memcpy a token at
        Qwen3-30B-A3B's shapes, on the cores the experts compute on)."""
        base = slot * self.cache.slot_bytes
        ranges, outs, at = [], [], base
        for (off, n, _), m in zip(
            layer.aligned_ranges(expert, self.direct.size), layer.matrices, strict=True
        ):
            ranges.append((off, n))
            outs.append(at)
            at += _align(m.nbytes) + ALIGN
        return ranges, outs

    def _layer(self, layer: int) -> ExpertLayer:
        ly = self.layers.get(layer)
        if ly is None:
            raise InvalidArgumentError(f"layer {layer} has no streamed experts")
        return ly

    # -- requests ----------------------------------------------------------------------
    def begin_layer(self) -> None:
        """A new layer step: the previous step's slots may be evicted again."""
        self._in_use.clear()
        self.cache.tick()

    def matrices(self, layer: int, experts) -> list[tuple[QuantTensor, ...]]:
        """(gate, up, down) of each expert of `layer` in `experts` (distinct ids), read
        from flash where not cached; they stay valid until the next begin_layer()."""
        ly = self._layer(layer)
        ids = [int(e) for e in experts]
        for e in ids:
            if not 0 <= e < ly.n_expert:
                raise InvalidArgumentError(f"expert {e} out of range 0..{ly.n_expert - 1}")
        st = self.stats
        st.needed += len(ids)
        cache = self.cache
        slots: list[int] = []
        ranges, outs, waits = [], [], []
        for e in ids:
            slot = cache.slot_of.get((layer, e))
            if slot is not None:
                if slot in self._prefetched:  # brought by a prefetch: its first use
                    self._prefetched.discard(slot)
                    st.prefetch_used += 1
                else:
                    st.hits += 1
                fut = self._pending.get(slot)
                if fut is not None:
                    waits.append(slot)
            else:
                slot = cache.take((layer, e), self._in_use | set(self._pending))
                self._prefetched.discard(slot)
                r, o = self._reads(ly, e, slot)
                ranges += r
                outs += o
            self._in_use.add(slot)
            cache.touch(slot)
            slots.append(slot)
        t0 = time.perf_counter()
        if ranges:
            self.direct.read_into(ranges, cache.buffer, outs)
            st.bytes_read += sum(n for _, n in ranges)  # block padding included
        for slot in waits:
            self._pending.pop(slot).result()
        st.io_s += time.perf_counter() - t0
        return [self._views(ly, e, s) for e, s in zip(ids, slots, strict=True)]

    def prefetch(self, layer: int, experts) -> int:
        """Start reading the experts of `layer` among `experts` that are not cached, on a
        background thread, into slots no current step needs; returns how many."""
        ly = self.layers.get(layer)
        if ly is None:
            return 0
        self._reap()
        cache = self.cache
        ranges, outs, slots = [], [], []
        budget = cache.capacity - len(self._in_use) - len(self._pending)
        for e in experts:
            e = int(e)
            if (layer, e) in cache or len(slots) >= budget - 1:
                continue
            slot = cache.take((layer, e), self._in_use | set(self._pending) | set(slots))
            cache.touch(slot)
            r, o = self._reads(ly, e, slot)
            ranges += r
            outs += o
            slots.append(slot)
        if not slots:
            return 0
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="edgerun-experts")
        fut = self._pool.submit(self.direct.read_into, ranges, cache.buffer, outs)
        for s in slots:
            self._pending[s] = fut
            self._prefetched.add(s)
        self.stats.prefetched += len(slots)
        self.stats.bytes_read += sum(n for _, n in ranges)
        return len(slots)

    def _reap(self) -> None:
        """Forget prefetches that finished (raising a failed one's error here)."""
        for s in [s for s, f in self._pending.items() if f.done()]:
            self._pending.pop(s).result()

    def wait(self) -> None:
        """Wait for every prefetch in flight."""
        for s in list(self._pending):
            self._pending.pop(s).result()

    def close(self) -> None:
        self.wait()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    @property
    def cached(self) -> int:
        return len(self.cache)

    @staticmethod
    def slots_for(nbytes: int, layers: list[ExpertLayer]) -> int:
        """How many expert slots `nbytes` holds."""
        return int(nbytes // max(ly.slot_bytes() for ly in layers))


def top_experts(router: np.ndarray, x: np.ndarray, k: int) -> np.ndarray:
    """The k experts a router [n_expert, d_model] f32 scores highest for any row of x
    [n, d_model] (the union over rows, most rows' picks first)."""
    logits = x @ router.T
    k = min(k, router.shape[0])
    top = np.argpartition(-logits, k - 1, axis=1)[:, :k]
    ids, counts = np.unique(top, return_counts=True)
    return ids[np.argsort(-counts, kind="stable")]


def expert_read_bound(bytes_per_token: float, bandwidth: float) -> float:
    """tok/s that reading `bytes_per_token` at `bandwidth` bytes/s allows."""
    return math.inf if bytes_per_token <= 0 else bandwidth / bytes_per_token


class LayerExperts:
    """One layer's view of a StreamedExperts: the ExpertSource a MoEFFN reads its routed
    experts from (model/moe.py). After each request it starts the prefetch the layer's
    executor left as a hint (`hint`: the next layer's likely experts)."""

    def __init__(self, stream: StreamedExperts, layer: int) -> None:
        self.stream = stream
        self.layer = layer
        self.n_expert = stream._layer(layer).n_expert
        self.hint: list[tuple[int, np.ndarray]] = []  # (layer, experts) to prefetch

    def experts(self, ids):
        from edgerun.model.moe import ExpertMatrices

        self.stream.begin_layer()
        out = [ExpertMatrices(*m) for m in self.stream.matrices(self.layer, ids)]
        hint, self.hint = self.hint, []
        for layer, predicted in hint:
            self.stream.prefetch(layer, predicted)
        return out


class NextRouter(NamedTuple):
    """A later layer's router, applied ahead to predict the experts it will pick: its
    matrix, and the gain and epsilon of the RMSNorm it applies to the residual stream
    (None where it reads the FFN's input as it arrives)."""

    layer: int
    router: QuantTensor
    gain: np.ndarray | None
    eps: float


class StreamedMoEFFN:
    """A MoEFFN whose routed experts stream from flash (LayerExperts), timed, with the
    next layer's likely experts prefetched from its router applied to this layer's input.

    A call's rows are split so the experts they pick fit the cache at once (a prompt
    chunk of many rows can pick every expert of a layer; routing is per row, so the
    split changes which rows share a matmul, not what a row is routed to)."""

    # rows of a call whose picks prefetch the next layer's (a prompt chunk reads its
    # experts anyway, and would fill the prefetch with nearly every expert)
    PREFETCH_ROWS = 4

    def __init__(self, moe, source: LayerExperts, next_routers: Sequence[NextRouter] = ()) -> None:
        self.moe, self.source = moe, source
        self.next_routers = list(next_routers)
        self.d_model, self.d_ff, self.n_expert = moe.d_model, moe.d_ff, moe.n_expert
        stream = source.stream
        spare = stream.cache.capacity - moe.n_used  # one request's worth kept for prefetch
        self.max_rows = max(1, spare // moe.n_used)

    def _predict(self, x: np.ndarray) -> None:
        if not self.next_routers or x.shape[0] > self.PREFETCH_ROWS:
            return
        from edgerun.ops import qmatvec

        k = self.moe.n_used
        hint = []
        for layer, router, gain, eps in self.next_routers:
            # a router beside an MLP norms the residual stream it reads (this FFN's x)
            xr = x if gain is None else rmsnorm(x, gain, eps)
            if xr.shape[0] > 1:
                logits = qmatvec.project(router, xr)
            else:
                logits = qmatvec.matvec(router, xr[0])
            logits = np.asarray(logits, np.float32).reshape(x.shape[0], -1)
            top = np.argpartition(-logits, k - 1, axis=1)[:, :k]
            hint.append((layer, np.unique(top)))
        self.source.hint = hint

    def _run(self, x: np.ndarray, decode: bool) -> np.ndarray:
        st = self.source.stream.stats
        io0, t0 = st.io_s, time.perf_counter()
        if self.source.layer == min(self.source.stream.layers):
            st.tokens += x.shape[0]
        st.calls += 1
        call = self.moe.decode_batch if decode else self.moe
        if x.shape[0] <= self.max_rows:
            self._predict(x)
            out = call(x)
        else:
            out = np.empty_like(x)
            for r in range(0, x.shape[0], self.max_rows):
                out[r : r + self.max_rows] = call(x[r : r + self.max_rows])
        st.compute_s += time.perf_counter() - t0 - (st.io_s - io0)
        return out

    def weight_matrices(self) -> list[QuantTensor]:
        """One of each matrix this layer reads (MoEFFN.weight_matrices: the kernels'
        warm-up takes their formats; expert 0 is read into the cache for it)."""
        return self.moe.weight_matrices()

    @property
    def reads_stream(self) -> bool:
        return self.moe.reads_stream

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self._run(np.ascontiguousarray(x, np.float32), decode=False)

    def decode_batch(self, x: np.ndarray) -> np.ndarray:
        return self._run(np.ascontiguousarray(x, np.float32), decode=True)


class ExpertStreamStore(ResidentStore):
    """A mixture-of-experts model under a RAM budget (an experts plan): every tensor but
    the routed experts read once into RAM with direct I/O (offload/store.DirectTensors:
    the mapping is never faulted, so no readahead drags expert pages into the page cache),
    the routed experts streamed into one expert cache of the plan's slots
    (StreamedExperts), shared by all layers."""

    def __init__(self, reader, source: str, spec, plan, options) -> None:
        from edgerun.offload.store import _direct_tensors

        self.direct = DirectReader(reader.path, threads=options.io_threads)
        # attention the plan puts on a GPU stays mapped: the placement reads it from there
        moved = frozenset(
            spec.layer_tensor(r, i) for i in plan.gpu_attention_layers for r in ATTENTION_ROLES
        )
        super().__init__(_direct_tensors(reader, spec, self.direct, moved), source)
        self.plan, self.options, self.spec = plan, options, spec
        self.layers = expert_layers(spec, reader, source)
        self.stats = ExpertStats()
        slots = plan.expert_slots or StreamedExperts.slots_for(plan.cache_bytes, self.layers)
        self.experts = StreamedExperts(self.direct, self.layers, slots, self.stats)
        self._ahead = options.prefetch_layers

    def ffn(self, spec, layer: int):
        from edgerun.model.moe import is_moe_layer, moe_ffn, router_gain

        if not is_moe_layer(spec, self, layer):
            return super().ffn(spec, layer)
        self.check_vectors(spec, layer)
        source = LayerExperts(self.experts, layer)
        moe = moe_ffn(self, spec, layer, self._source, experts=source)
        ahead = [
            NextRouter(
                j,
                self.matrix(spec.expert_tensor("ffn_gate_inp", j)),
                router_gain(self, spec, j, self._source),
                spec.norm_eps,
            )
            for j in range(layer + 1, min(spec.n_layers, layer + 1 + self._ahead))
            if is_moe_layer(spec, self, j)
        ]
        return StreamedMoEFFN(moe, source, ahead)

    @property
    def flash_reader(self) -> DirectReader:
        """The DirectReader all flash reads go through."""
        return self.direct

    def close(self) -> None:
        self.experts.close()

    def offload_stats(self) -> dict:
        st, r = self.stats, self.direct
        tokens = max(1, st.tokens)
        return {
            "bytes_read": int(r.bytes_read),
            "read_s": r.read_seconds,
            "io_s": st.io_s,
            "mm_s": 0.0,
            "compute_s": st.compute_s,
            "hit_rate": st.hit_rate,
            "ready_rate": st.ready_rate,
            "tokens": st.tokens,
            "active_fraction": self.spec.n_expert_used / self.spec.n_expert,
            "plan": self.plan.describe(),
            "pinned": 0,
            "prefetch_hits": st.prefetch_used,
            "prefetch_wasted": max(0, st.prefetched - st.prefetch_used),
            "experts_needed": st.needed / tokens,
            "expert_hits": st.hits / tokens,
            "expert_bytes_read": st.bytes_read / tokens,
            "expert_cache": f"{len(self.experts.cache)}/{self.experts.cache.capacity}",
        }

    def reset_offload_stats(self) -> None:
        self.experts.wait()
        self.direct.reset_stats()
        self.stats.reset()


def stats_line(stats: dict | None) -> str | None:
    """A one-line summary of an experts-mode store's offload_stats() (per token: rows
    the MoE layers ran over, the prompt's included); None for any other store."""
    if not stats or "experts_needed" not in stats:
        return None
    t = max(1, stats.get("tokens", 1))
    return (
        f"experts on flash: {stats['experts_needed']:.0f} needed a token, "
        f"{stats['hit_rate']:.0%} cache hits, {stats['ready_rate']:.0%} ready without a wait "
        f"(prefetch), {stats['bytes_read'] / t / 1e6:,.1f} MB read a token, I/O wait "
        f"{1e3 * stats['io_s'] / t:,.1f} ms, compute {1e3 * stats['compute_s'] / t:,.1f} ms "
        f"a token; cache {stats['expert_cache']} experts"
    )
