"""Placement: from a RAM budget and a model's footprint to a home for every part.

The budget is the whole process as a memory cgroup counts it: RSS including mapped
file pages, plus the page cache our reads leave (offloaded reads bypass it with
O_DIRECT, so they leave none). The runtime measures its own floor (interpreter,
numpy, Numba, kernels, tokenizer, metadata) and plans the rest:

1. mandatory: floor, KV cache, attention weights, norms, output head, the embedding
   rows a conversation touches, one layer's scratch for neurons that miss the cache;
2. the gate rows, when they fit (exact gate-resident thresholding); otherwise a
   low-rank gate predictor, and the gate rows of active neurons come from flash;
3. everything left is the neuron cache (windowing), split evenly over the layers.

Byte for byte, a resident attention or head byte saves one byte read per token, a
gate byte saves the gate bytes of the active neurons, a cache byte saves only what
it hits; that is the order above.

Dense streaming (the FFN's first rows held, the rest read every token) treats an
untied output head as one more streamed matrix: its bytes, held or read, cost the same
per token as the FFN's, and streaming it lowers the minimum budget by its size (191 MB
on Qwen2.5-1.5B).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from edgerun.errors import BudgetError, InvalidArgumentError, ModelFormatError

MiB = 1 << 20
# Embedding rows a long conversation touches, page-granular (4 KiB a distinct token).
EMBEDDING_TOUCH_BYTES = 16 * MiB
# Transient arrays of one forward step (logits, activations, staging buffers); under a
# budget a prompt chunk is sized so its temporaries fit (engine.prefill_chunk_within).
STEP_MARGIN_BYTES = 24 * MiB
# What the process's later reads leave in the page cache and its heap keeps, which the
# load's drop cannot see coming (modules first imported by a request, freed fragments):
# after a 1990-token prompt of Qwen2.5-1.5B at 800M, 14.6 MB of unmapped page cache
# that no part of the plan counts (benchmarks/budget_soak.py --no-limit).
LATE_MEMORY_BYTES = 8 * MiB
MARGIN_BYTES = STEP_MARGIN_BYTES + LATE_MEMORY_BYTES  # what every plan keeps unassigned
# Cache misses are read and computed this many neurons at a time.
SCRATCH_NEURONS = 1024
# Prefetched records of the next layer wait in a staging matrix of this many neurons.
PREFETCH_NEURONS = 4096


def parse_budget(text: str | int, total_bytes: int | None = None, what: str = "RAM budget") -> int:
    """'800M', '1.5G', '560MB', '60%' (of total_bytes, the machine's RAM) or bytes -> bytes."""
    if isinstance(text, int):
        if text <= 0:
            raise BudgetError(f"{what} must be positive, got {text}")
        return text
    s = str(text).strip()
    m = re.fullmatch(r"(?i)(\d+(?:\.\d+)?)\s*(%|[kmgt]i?b?|b)?", s)
    if not m:
        raise BudgetError(
            f"cannot read {what} {text!r}: expected a size like 800M, 1.5G or a percentage like 60%"
        )
    value, unit = float(m.group(1)), (m.group(2) or "b").lower()
    if unit == "%":
        if not 0 < value <= 100:
            raise BudgetError(f"{what} {text!r}: a percentage must be in (0, 100]")
        if total_bytes is None:
            import psutil

            total_bytes = int(psutil.virtual_memory().total)
        out = int(total_bytes * value / 100)
    else:
        scale = {"b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[unit[0]]
        out = int(value * scale)
    if out <= 0:
        raise BudgetError(f"{what} {text!r} is zero")
    return out


@dataclass(frozen=True)
class Footprint:
    """Sizes of a model's parts, as the planner needs them (bytes)."""

    n_layers: int
    d_model: int
    d_ff: int
    attention_bytes: int  # q, k, v, o and their biases/norms, all layers
    head_bytes: int  # output head (0 when tied to the embedding)
    embedding_bytes: int  # the whole token embedding (only touched rows count)
    norm_bytes: int
    gate_row_bytes: int  # one neuron's gate row
    record_bytes: int  # one neuron's bundled up row + down column on flash
    dense_ffn_bytes: int  # the FFN as the source file stores it, all layers
    kv_bytes_per_token: int
    # one sequence's recurrent states with their snapshots (hybrid models; KVCache.state)
    state_bytes: int = 0
    attn_weights: int = 0  # q, k, v, o weights of one layer (elements), for device sizing
    # (block format, bytes) of the attention and the dense FFN, all layers, and the
    # formats of the output head, a gate row, an up row and a bundled down column
    attention_by_format: tuple[tuple[str, int], ...] = ()
    ffn_by_format: tuple[tuple[str, int], ...] = ()
    head_format: str = ""
    gate_format: str = ""
    up_format: str = ""
    down_format: str = "Q8_0"
    up_row_bytes: int = 0
    head_rows: int = 0  # vocabulary rows of an untied head
    # mixture of experts (offload/experts.py): one routed expert's bytes in the file (its
    # gate, up and down), how many a layer has and a token uses, and the routers and
    # shared experts of all layers (resident)
    expert_bytes: int = 0
    n_expert: int = 0
    n_expert_used: int = 0
    moe_resident_bytes: int = 0
    expert_format: str = ""

    def kv_bytes(self, n_ctx: int) -> int:
        """What a sequence of n_ctx positions holds: its KV rows and recurrent states."""
        return n_ctx * self.kv_bytes_per_token + self.state_bytes

    # Gemma 4's per-layer embedding table: a lookup like the token embedding (a token
    # reads its own rows from storage), so only the touched rows count, never the table
    per_layer_table_bytes: int = 0

    def attention_formats(self) -> tuple[tuple[str, int], ...]:
        return self.attention_by_format or (("", self.attention_bytes),)

    def ffn_formats(self) -> tuple[tuple[str, int], ...]:
        return self.ffn_by_format or (("", self.dense_ffn_bytes),)

    @property
    def gate_bytes(self) -> int:
        return self.n_layers * self.d_ff * self.gate_row_bytes

    @property
    def dense_neuron_bytes(self) -> float:
        """One neuron's share of the FFN as the file stores it (gate and up rows, a
        d_ff-th of down), averaged over the layers."""
        return self.dense_ffn_bytes / (self.n_layers * self.d_ff)

    @property
    def neuron_bytes(self) -> int:
        """Gate row + bundled record of one neuron."""
        return self.gate_row_bytes + self.record_bytes

    def predictor_bytes(self, rank: int) -> int:
        """A rank-r f16 factor of every gate (x -> x V_r -> S_r U_r^T)."""
        return self.n_layers * rank * (self.d_model + self.d_ff) * 2


@dataclass
class Plan:
    """Where every part lives, and what it should cost per token."""

    mode: str  # "sparse" | "dense" | "resident"
    budget: int
    floor: int
    kv_bytes: int  # the KV cache and, for a hybrid model, its recurrent states
    resident_bytes: int  # attention + norms + head + embedding rows + margins
    gate_resident: bool
    predictor_bytes: int
    scratch_bytes: int
    cache_neurons: int  # per CPU layer
    cache_bytes: int
    flash_bytes: int  # what stays on flash
    read_bytes_per_token: float
    predicted_tok_s: float
    active_fraction: float
    gate_bytes: int = 0  # gate rows held in RAM (0 when they stay on flash)
    notes: list[str] = field(default_factory=list)
    n_layers: int = 0
    d_ff: int = 0  # neurons a layer (0: not recorded)
    pinned_neurons: int = 0  # per CPU layer: the profile's hottest, never evicted
    gpu_budget: int = 0
    gpu_ffn_layers: tuple[int, ...] = ()  # layers whose FFN runs on the torch device
    gpu_attention_layers: tuple[int, ...] = ()  # layers whose q/k/v/o run there
    gpu_bytes: int = 0  # weights on the device
    time_split: dict[str, float] = field(default_factory=dict)  # predicted s per token
    # Of cache_neurons / cache_bytes: held only once the kernels are loaded (dense mode;
    # their load needs that memory for a moment, then LLVM's pages are given back)
    deferred_neurons: int = 0
    deferred_bytes: int = 0
    # dense mode, an untied head: its rows are held in the FFN's share and the rest
    # streamed (cache_bytes and read_bytes_per_token count them; with a sketch see
    # head_held_rows)
    head_streamed: bool = False
    # dense mode, a streamed head whose other rows stay on flash: a low-rank sketch of them
    # (its RAM: head_sketch_bytes, in resident_bytes) picks head_candidates a token to read
    # (offload/head.py); 0: they are streamed every token
    head_candidates: int = 0
    head_sketch_bytes: int = 0
    # with a sketch: the head's first rows held, a fixed count (their bytes in
    # resident_bytes), since a token reads only candidates whatever the count: the held
    # rows buy exactness on the most used tokens, and the FFN's rows each save a read
    head_held_rows: int = 0
    # dense mode: streamed rows held on memory the budget reserves but does not use yet
    # (offload/kv_loan.py), which read_bytes_per_token and predicted_tok_s count: what a
    # running model measured it lends (Model.predicted_plan), or an estimate
    lent_bytes: int = 0
    # experts mode (offload/experts.py): the expert cache's slots (whole routed experts,
    # all layers share them) out of every routed expert of the model, and one's bytes
    expert_slots: int = 0
    experts_total: int = 0
    expert_bytes: int = 0

    # of kv_bytes: one sequence's recurrent states, snapshots included (hybrid models)
    state_bytes: int = 0

    @property
    def used_bytes(self) -> int:
        return (
            self.floor
            + self.kv_bytes
            + self.resident_bytes
            + self.predictor_bytes
            + self.scratch_bytes
            + self.cache_bytes
            + (self.gate_bytes if self.gate_resident else 0)
        )

    def pass_seconds(self, rows: int, row_cost: float) -> float:
        """Predicted seconds of one decode pass of `rows` consecutive tokens of a sequence
        (a speculative verification), from time_split. Compute (CPU and GPU) grows by
        `row_cost` of itself per extra row (the batched kernels' measured price of a row,
        DraftLength.row_cost). Reads:
        - dense: the streamed rows are read once for all rows, by a thread that runs
          beside the compute, so the pass takes the longer of the two;
        - sparse: each row needs its own active neurons: the union of `rows` independent
          draws of active_fraction;
        - experts: each row routes to its own experts (random routing, the worst case),
          so the reads grow with the rows."""
        if rows < 1:
            raise InvalidArgumentError(f"a pass has at least one row, got {rows}")
        split = self.time_split
        grow = 1.0 + (rows - 1) * row_cost
        compute = (split.get("cpu", 0.0) + split.get("gpu", 0.0)) * grow
        layers = split.get("layers", 0.0)
        flash = split.get("flash", 0.0)
        if self.mode == "dense":
            if flash <= 0.0:  # the reads already hide behind one row's compute
                return compute + layers
            read = flash + split.get("cpu", 0.0) + layers
            return max(read, compute + layers)
        if self.mode == "sparse":
            f = min(max(self.active_fraction, 1e-6), 1.0)
            flash *= (1.0 - (1.0 - f) ** rows) / f
        elif self.mode == "experts":
            flash *= rows
        return compute + layers + flash

    def pass_costs(self, max_rows: int, row_cost: float) -> dict[int, float]:
        """pass_seconds of 2..max_rows rows in one-row passes: DraftLength's starting
        prices of verification passes under this plan, before any is measured."""
        one = self.pass_seconds(1, row_cost)
        if one <= 0.0:
            return {}
        return {r: self.pass_seconds(r, row_cost) / one for r in range(2, max_rows + 1)}

    @property
    def fixed_head(self) -> bool:
        """A streamed head holding a fixed count of rows (its others sketched), counted in
        resident_bytes, not in the FFN's share."""
        return self.head_streamed and bool(self.head_candidates or self.head_held_rows)

    def placement(self) -> list[tuple[str, str, str]]:
        """(part, home, detail) rows: where every tensor group and neuron group lives."""
        rows: list[tuple[str, str, str]] = []
        L = self.n_layers
        cpu_ffn = [i for i in range(L) if i not in set(self.gpu_ffn_layers)]
        cpu_att = [i for i in range(L) if i not in set(self.gpu_attention_layers)]
        if self.gpu_attention_layers:
            rows.append(("attention q/k/v/o", "GPU", _layers(self.gpu_attention_layers)))
        if self.gpu_ffn_layers:
            rows.append(("FFN gate/up/down", "GPU", _layers(self.gpu_ffn_layers)))
        if cpu_att:
            rows.append(("attention q/k/v/o", "RAM", _layers(cpu_att)))
        head = "" if self.head_streamed else "output head, "
        rows.append((f"norms, {head}embedding rows", "RAM", "whole model"))
        if not cpu_ffn:
            return rows
        where = _layers(cpu_ffn)
        if self.mode == "experts":
            mb = self.expert_bytes / MiB
            rows.append(("routers, shared experts", "RAM", where))
            rows.append(
                (
                    "routed experts, cache",
                    "RAM",
                    f"{self.expert_slots:,} of {self.experts_total:,} experts "
                    f"({mb:,.2f} MiB each), LRU + frequency",
                )
            )
            rows.append(("routed experts", "flash, read when routed (direct I/O)", where))
            return rows
        if self.mode == "resident":
            rows.append(("FFN gate/up/down", "RAM (mmap)", where))
            return rows
        if self.mode != "dense":
            rows.append(("FFN gate rows", "RAM" if self.gate_resident else "flash", where))
        if self.mode == "dense":
            share = f"{self.cache_neurons / self.d_ff:.0%}" if self.d_ff else "a share"
            rows.append(("FFN first rows of gate/up/down", "RAM", f"{where}: {share} of each"))
            rows.append(("FFN other rows", "flash, streamed each token (file format)", where))
            if self.head_streamed and self.head_candidates:
                rows.append(
                    (
                        "output head",
                        "RAM / flash",
                        f"first {self.head_held_rows:,} rows held; a "
                        f"{self.head_sketch_bytes / MiB:,.1f} MiB sketch picks "
                        f"{self.head_candidates} of the others a token to read",
                    )
                )
            elif self.head_streamed:
                rows.append(("output head", "RAM / flash", f"first {share} of its rows held"))
            return rows
        if self.pinned_neurons:
            rows.append(
                ("FFN hottest neurons", "RAM pinned", f"{where}: {self.pinned_neurons} a layer")
            )
        window = self.cache_neurons - self.pinned_neurons
        if window > 0:
            rows.append(("FFN recent neurons", "RAM window", f"{where}: {window} a layer"))
        rows.append(("FFN cold neurons", "flash, read when active", where))
        return rows

    def _ffn_rows(self) -> list[tuple[str, str]]:
        mb = MiB
        if self.mode == "experts":
            return [
                ("read staging", f"{self.scratch_bytes / mb:,.0f} MiB"),
                (
                    "expert cache",
                    f"{self.cache_bytes / mb:,.0f} MiB ({self.expert_slots:,} experts of "
                    f"{self.experts_total:,})",
                ),
            ]
        if self.mode == "dense":
            return [
                ("read-ahead ring", f"{self.scratch_bytes / mb:,.0f} MiB"),
                (
                    "FFN and head rows held in RAM"
                    if self.head_streamed and not self.fixed_head
                    else "FFN rows held in RAM",
                    f"{self.cache_bytes / mb:,.0f} MiB ({self.cache_neurons} neurons' worth a "
                    "layer)",
                ),
            ]
        return [
            (
                "gate rows",
                f"{self.gate_bytes / mb:,.0f} MiB in RAM" if self.gate_resident else "on flash",
            ),
            ("gate predictor", f"{self.predictor_bytes / mb:,.0f} MiB"),
            ("scratch for cache misses", f"{self.scratch_bytes / mb:,.0f} MiB"),
            (
                "neuron cache",
                f"{self.cache_bytes / mb:,.0f} MiB ({self.cache_neurons} neurons a layer"
                + (f", {self.pinned_neurons} pinned hot)" if self.pinned_neurons else ")"),
            ),
        ]

    def describe(self) -> str:
        mb = MiB
        rows = [
            ("RAM budget", f"{self.budget / mb:,.0f} MiB" if self.budget < 1 << 60 else "none"),
            ("runtime floor (measured)", f"{self.floor / mb:,.0f} MiB"),
            ("KV cache", f"{(self.kv_bytes - self.state_bytes) / mb:,.0f} MiB"),
            *(
                [("recurrent states, with snapshots", _mib_or_kib(self.state_bytes))]
                if self.state_bytes
                else []
            ),
            (
                "resident: attention, norms, "
                + (
                    "embeddings, head rows and sketch"
                    if self.fixed_head
                    else "embeddings"
                    if self.head_streamed
                    else "head, embeddings"
                ),
                f"{self.resident_bytes / mb:,.0f} MiB",
            ),
            *self._ffn_rows(),
            ("stays on flash", f"{self.flash_bytes / mb:,.0f} MiB"),
            ("planned total", f"{self.used_bytes / mb:,.0f} MiB"),
        ]
        if self.gpu_budget:
            rows.append(
                (
                    "GPU",
                    f"{self.gpu_bytes / mb:,.0f} of {self.gpu_budget / mb:,.0f} MiB: FFN of "
                    f"{len(self.gpu_ffn_layers)} layers, attention of "
                    f"{len(self.gpu_attention_layers)}",
                )
            )
        if self.lent_bytes:
            rows.append(("rows lent (KV loan)", f"{self.lent_bytes / mb:,.0f} MiB"))
        rows += [
            ("predicted read per token", f"{self.read_bytes_per_token / mb:,.1f} MiB"),
            ("predicted decode", f"{self.predicted_tok_s:,.1f} tok/s"),
        ]
        if self.time_split:
            split = ", ".join(f"{k} {v * 1e3:,.1f}" for k, v in self.time_split.items())
            rows.append(("predicted ms per token", split))
        w = max(len(k) for k, _ in rows)
        head = "resident (no offloading)" if self.mode == "resident" else f"{self.mode} offloading"
        lines = [f"plan: {head}"] + [f"  {k:<{w}}  {v}" for k, v in rows]
        if self.n_layers:
            p = self.placement()
            w1 = max(len(r[0]) for r in p)
            w2 = max(len(r[1]) for r in p)
            lines.append("  where each part lives:")
            lines += [f"    {a:<{w1}}  {b:<{w2}}  {c}" for a, b, c in p]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _mib_or_kib(n: int) -> str:
    return f"{n / MiB:,.0f} MiB" if n >= MiB else f"{n / 1024:,.0f} KiB"


def _layers(ids) -> str:
    """'layers 0-23, 26' for a list of layer indices."""
    ids = sorted(ids)
    if not ids:
        return "no layer"
    out, start, prev = [], ids[0], ids[0]
    for i in ids[1:] + [None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return "layers " + ", ".join(out)


@dataclass(frozen=True)
class DeviceFigures:
    """Measured rates the prediction uses (device/calibration.py measures them; the
    defaults are this machine kind's, PERF_NOTES)."""

    flash_read_bytes_s: float = 600e6  # O_DIRECT, 32-128 KiB reads, 4 threads
    ram_stream_bytes_s: float = 20e9  # quantized weight bytes the CPU kernels consume
    flash_by_chunk: tuple[tuple[int, float], ...] = ()  # (read size, bytes/s)
    layer_overhead_s: float = 0.0  # fixed cost of one layer's kernel calls
    gpu_matvec_bytes_s: float = 0.0  # device weight bytes a second (0: no device)
    gpu_call_s: float = 0.0  # one executor call's host->device->host round trip
    cpu_by_format: tuple[tuple[str, float], ...] = ()  # (block format, matvec bytes/s)
    flash_stream_bytes_s: float = 0.0  # dense streaming's one-thread piece reads (0: unknown)

    def cpu_rate(self, fmt: str | None = None) -> float:
        """The CPU kernels' bytes/s on `fmt` blocks (the mean rate when not measured)."""
        for name, rate in self.cpu_by_format:
            if name == fmt:
                return rate
        return self.ram_stream_bytes_s

    def cpu_seconds(self, by_format, share: float = 1.0) -> float:
        """Time to stream (format, bytes) pairs through the matvec kernels."""
        return sum(share * n / self.cpu_rate(f) for f, n in by_format)

    def flash_rate(self, chunk: int) -> float:
        """Read throughput at `chunk`-byte reads, interpolated on log2(size)."""
        if not self.flash_by_chunk:
            return self.flash_read_bytes_s
        from edgerun.offload.io import interpolate_rate

        return interpolate_rate(self.flash_by_chunk, chunk)

    def stream_rate(self) -> float:
        """Dense streaming's read rate: measured on the row stream itself, else the
        rate of its piece size."""
        from edgerun.offload.rowstream import PIECE_BYTES

        return self.flash_stream_bytes_s or self.flash_rate(PIECE_BYTES)


# Miss densities (share of a layer's neurons read in one token) the offload path is
# timed at (sched/calibration.measure_offload).
DENSITIES = (0.02, 0.1, 0.3, 0.6, 0.9)


@dataclass(frozen=True)
class OffloadFigures:
    """Seconds per neuron of the offload executors on one model's bundle (measured)."""

    sparse_read_s: tuple[tuple[float, float], ...]  # (miss density, s per missed record)
    stream_read_s: float  # s per neuron streamed (gate row + record, contiguous)
    neuron_compute_s: float  # up row . x and the down column added, from a record
    gate_compute_s: float  # one gate row . x from a streamed gate row

    def read_s(self, density: float) -> float:
        """Seconds per missed record at this miss density (interpolated)."""
        pts = sorted(self.sparse_read_s)
        if density <= pts[0][0]:
            return pts[0][1]
        for (q0, s0), (q1, s1) in zip(pts, pts[1:]):
            if density <= q1:
                return s0 + (density - q0) / (q1 - q0) * (s1 - s0)
        return pts[-1][1]


# Dense streaming reads SCRATCH_NEURONS records at a time; sparse reads merge records
# this close together (OffloadOptions.gap_bytes) into one read.
DENSE_READ_BYTES = 1 << 20
GAP_BYTES = 32768


def _resident_bytes(
    fp: Footprint, cpu_attention_share: float = 1.0, head_streamed: bool = False
) -> int:
    return (
        int(fp.attention_bytes * cpu_attention_share)
        + fp.norm_bytes
        + (0 if head_streamed else fp.head_bytes)
        + min(fp.embedding_bytes, EMBEDDING_TOUCH_BYTES)
        + min(fp.per_layer_table_bytes, EMBEDDING_TOUCH_BYTES)
        + MARGIN_BYTES
    )


def _streamed_resident_seconds(fp: Footprint, dev: DeviceFigures, att_share: float) -> float:
    """CPU time of what a decode step reads of the resident part: attention (the share on
    the CPU), norms, output head (the embedding when tied); not the margins."""
    head = fp.head_bytes or fp.embedding_bytes
    return dev.cpu_seconds(fp.attention_formats(), att_share) + dev.cpu_seconds(
        ((fp.head_format, head), ("F32", fp.norm_bytes))
    )


def _neuron_seconds(fp: Footprint, dev: DeviceFigures, gate: bool = True) -> float:
    """CPU time of one neuron computed from bundled rows: up row, down column (and the
    gate row when it is computed with them)."""
    up = fp.up_row_bytes or fp.record_bytes // 2
    t = up / dev.cpu_rate(fp.up_format) + (fp.record_bytes - up) / dev.cpu_rate(fp.down_format)
    if gate:
        t += fp.gate_row_bytes / dev.cpu_rate(fp.gate_format)
    return t


def _scratch_bytes(fp: Footprint, prefetch: bool = False) -> int:
    """Neurons that miss the cache are read and computed in chunks of this many bytes;
    prefetching adds its staging matrix."""
    staged = min(fp.d_ff, PREFETCH_NEURONS) * fp.record_bytes if prefetch else 0
    # two chunks: one computing while the next is read
    return 2 * min(fp.d_ff, SCRATCH_NEURONS) * fp.neuron_bytes + staged


def _ring_bytes() -> int:
    """Dense streaming's read-ahead ring and the readers' staging buffers."""
    from edgerun.offload.io import ALIGN, CHUNK, IO_THREADS
    from edgerun.offload.rowstream import PIECE_BYTES, RING_SLOTS

    return RING_SLOTS * (PIECE_BYTES + 2 * ALIGN) + IO_THREADS * (CHUNK + 2 * ALIGN)


def _missed_fraction(cache_neurons: int, d_ff: int, frequencies=None, pinned: int = 0) -> float:
    """Share of a token's active neurons the cache does not hold.

    With measured activation frequencies (per layer arrays), the `pinned` most frequent
    neurons are always held and the rest of the cache (the window) is assumed to hold a
    uniform share of the others; without a profile nothing is pinned and every neuron is
    equally likely. (The window does better than uniform when tokens repeat neurons; the
    prediction stays on the safe side.)
    """
    if d_ff == 0:
        return 0.0
    if frequencies is None or pinned <= 0:
        return max(0.0, 1.0 - cache_neurons / d_ff)
    window = max(0, cache_neurons - pinned)
    miss = []
    for f in frequencies:
        f = sorted((float(v) for v in f), reverse=True)
        total = sum(f) or 1.0
        covered = sum(f[:pinned]) / total
        rest = max(1, d_ff - pinned)
        miss.append(max(0.0, (1.0 - covered) * (1.0 - window / rest)))
    return sum(miss) / len(miss)


def _sparse_read(
    misses: float, d_ff: int, record: int, gap_bytes: int = GAP_BYTES, align: int = 4096
) -> tuple[float, float]:
    """(bytes read, mean bytes per read) for `misses` random records of one layer.

    The bundle reader merges records separated by at most gap_bytes of others into one
    read and widens reads to `align` (bundle.Bundle._read_rows). With q = misses / d_ff,
    the run of unneeded records after a miss is j with probability q (1 - q)^j; runs up
    to gap_bytes / record are read as filler, a longer one ends the read (one more
    aligned page). Dense misses therefore cost the layer's whole span: on SmolLM2 at
    19% misses the reader took 39-44 MB a token where the records alone are 8.
    """
    if misses <= 0:
        return 0.0, float(align)
    q = min(1.0, misses / d_ff)
    J = gap_bytes // record
    filler = sum(q * (1 - q) ** j * j * record for j in range(J + 1))
    p_break = (1 - q) ** (J + 1)
    per_miss = record + filler + p_break * align
    total = min(misses * per_miss, d_ff * record + align)
    reads = max(1.0, misses * p_break)
    return total, total / reads


def _gpu_layer_bytes(fp: Footprint, dtype_bytes: int) -> tuple[int, int]:
    """(FFN, attention) bytes of one layer on the device."""
    return 3 * fp.d_ff * fp.d_model * dtype_bytes, fp.attn_weights * dtype_bytes


def _choose_gpu(
    fp: Footprint,
    gpu_budget: int,
    dev: DeviceFigures,
    dtype_bytes: int,
    ffn_cost_s: float,
    force: bool = False,
) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """Greedy benefit per byte: each layer's FFN and attention are candidate groups; the
    benefit is the CPU (and flash) time a token saves minus the device time and the call's
    round trip. Layers are alike, so groups of one kind go in layer order. `force` places
    groups that do not pay too (torch on the CPU, which only tests the path). A
    mixture-of-experts model offers attention only: its routed experts stay on the CPU
    (resident or streamed from flash), as llama.cpp users keep them with -ot exps=CPU."""
    if gpu_budget <= 0 or dev.gpu_matvec_bytes_s <= 0:
        return (), (), 0
    L = fp.n_layers
    ffn_dev, att_dev = _gpu_layer_bytes(fp, dtype_bytes)
    att_cost = dev.cpu_seconds(fp.attention_formats()) / L
    groups = []
    for kind, nbytes, saved in (("ffn", ffn_dev, ffn_cost_s), ("attention", att_dev, att_cost)):
        if nbytes <= 0 or (kind == "ffn" and fp.n_expert):
            continue
        gain = saved - (nbytes / dev.gpu_matvec_bytes_s + dev.gpu_call_s)
        if gain > 0 or force:
            groups.append((gain / nbytes, kind, nbytes))
    groups.sort(reverse=True)
    left = gpu_budget
    chosen: dict[str, list[int]] = {"ffn": [], "attention": []}
    for _, kind, nbytes in groups:
        k = int(min(L, left // nbytes))
        chosen[kind] = list(range(k))
        left -= k * nbytes
    used = gpu_budget - left
    return tuple(chosen["ffn"]), tuple(chosen["attention"]), used


def _gpu_time(fp: Footprint, ffn_l, att_l, dev: DeviceFigures, dtype_bytes: int) -> float:
    ffn_dev, att_dev = _gpu_layer_bytes(fp, dtype_bytes)
    if not (ffn_l or att_l):
        return 0.0
    nbytes = len(ffn_l) * ffn_dev + len(att_l) * att_dev
    return nbytes / dev.gpu_matvec_bytes_s + (len(ffn_l) + 2 * len(att_l)) * dev.gpu_call_s


def resident_need(fp: Footprint, file_bytes: int, floor: int, n_ctx: int) -> int:
    """The budget that keeps the whole model resident: floor, KV cache, file, margins."""
    return floor + fp.kv_bytes(n_ctx) + file_bytes + MARGIN_BYTES


def resident_plan(
    fp: Footprint,
    file_bytes: int,
    budget: int,
    floor: int,
    n_ctx: int,
    device: DeviceFigures | None = None,
    gpu_budget: int = 0,
    gpu_dtype_bytes: int = 2,
    gpu_force: bool = False,
):
    """A Plan that keeps the whole model resident (mmap) when it fits the budget with
    room to spare, or None. Measured: when it fits, the page cache serves the mmap
    faster than any streaming (Qwen2.5-Coder-0.5B in 839 MiB: 11.0 tok/s mmap, 9.0
    dense offload)."""
    dev = device or DeviceFigures()
    kv = fp.kv_bytes(n_ctx)
    if resident_need(fp, file_bytes, floor, n_ctx) > budget:
        return None
    L = fp.n_layers
    ffn_l, att_l, gpu_used = _choose_gpu(
        fp,
        gpu_budget,
        dev,
        gpu_dtype_bytes,
        dev.cpu_seconds(fp.ffn_formats()) / L,
        gpu_force,
    )
    split = {
        "cpu": _streamed_resident_seconds(fp, dev, 1 - len(att_l) / L)
        + dev.cpu_seconds(fp.ffn_formats(), 1 - len(ffn_l) / L),
        "layers": L * dev.layer_overhead_s,
    }
    if ffn_l or att_l:
        split["gpu"] = _gpu_time(fp, ffn_l, att_l, dev, gpu_dtype_bytes)
    t = sum(split.values())
    return Plan(
        mode="resident",
        budget=budget,
        floor=floor,
        kv_bytes=kv,
        state_bytes=fp.state_bytes,
        resident_bytes=file_bytes + MARGIN_BYTES,
        gate_resident=True,
        predictor_bytes=0,
        scratch_bytes=0,
        cache_neurons=fp.d_ff,
        cache_bytes=0,
        flash_bytes=0,
        read_bytes_per_token=0.0,
        predicted_tok_s=1.0 / t if t > 0 else float("inf"),
        active_fraction=1.0,
        notes=["the whole model fits the budget: it stays resident (mmap), nothing streams"],
        n_layers=L,
        gpu_budget=gpu_budget,
        gpu_ffn_layers=ffn_l,
        gpu_attention_layers=att_l,
        gpu_bytes=gpu_used,
        time_split=split,
    )


def minimum_budget(
    fp: Footprint,
    floor: int,
    n_ctx: int,
    mode: str = "sparse",
    predictor_rank: int = 64,
    allow_predictor: bool = True,
    prefetch: bool = False,
) -> int:
    """The smallest budget `plan` accepts for this model and mode (dense mode streams
    all of an untied head then)."""
    base = floor + fp.kv_bytes(n_ctx) + _resident_bytes(fp, 1.0, mode == "dense")
    scratch = _ring_bytes() if mode == "dense" else _scratch_bytes(fp, prefetch)
    if mode == "dense":
        return base + scratch
    if not allow_predictor:
        return base + scratch + fp.gate_bytes
    return base + scratch + min(fp.predictor_bytes(predictor_rank), fp.gate_bytes)


def plan(
    fp: Footprint,
    budget: int,
    floor: int,
    n_ctx: int,
    mode: str = "sparse",
    active_fraction: float = 0.3,
    predictor_rank: int = 64,
    frequencies=None,
    device: DeviceFigures | None = None,
    allow_predictor: bool = True,
    prefetch: bool = False,
    hot_share: float = 0.0,
    gpu_budget: int = 0,
    gpu_dtype_bytes: int = 2,
    gpu_force: bool = False,
    gap_bytes: int = GAP_BYTES,
    offload: OffloadFigures | None = None,
    head_candidates: int = 0,
    head_rank: int = 64,
    head_held: int = 49152,
    lent_bytes: int = 0,
) -> Plan:
    """Split `budget` bytes between resident weights, gate, predictor and neuron cache,
    and `gpu_budget` bytes between layers' FFNs and attention on a torch device.

    active_fraction is the share of neurons a token needs (1 - sparsity) in sparse
    mode. With `frequencies` (a profile's per-layer activation counts) and hot_share > 0,
    that share of each layer's cache is pinned with its hottest neurons. Layers whose
    FFN goes to the GPU need no RAM for it, so the cache is split over the others.
    Raises BudgetError naming the minimum when the budget cannot hold the mandatory parts.
    With head_candidates (dense mode, an untied head), the head rows not held stay on
    flash and a rank-head_rank sketch of them in RAM picks that many a token to read
    (offload/head.py), instead of streaming them all; then the head's first head_held
    rows are held (fewer if the budget leaves less) and the FFN's share takes the rest.
    lent_bytes (dense mode): streamed rows held on loan (offload/kv_loan.py), which every
    token then does not read.

    Predicted time per token = the CPU's streamed bytes / its matvec rate + flash reads /
    the read rate at their size + device bytes / the device rate + one round trip per
    device call + a fixed cost per layer (DeviceFigures, measured by calibration). With
    `offload` (the executors timed on this model's bundle) the FFN's reads and compute
    take those per-neuron seconds instead of the rate model (sparse mode). Dense
    streaming reads ahead continuously, overlapping all the compute, so only what the
    reads take beyond it counts; sparse misses are read when the gate has chosen them,
    so their reads add.
    """
    if mode not in ("sparse", "dense"):
        raise InvalidArgumentError(f"offload mode must be 'sparse' or 'dense', got {mode!r}")
    if not 0 < active_fraction <= 1:
        raise InvalidArgumentError(f"active fraction must be in (0, 1], got {active_fraction}")
    dev = device or DeviceFigures()
    need = minimum_budget(fp, floor, n_ctx, mode, predictor_rank, allow_predictor, prefetch)
    if budget < need:
        raise BudgetError(
            f"RAM budget {budget / MiB:,.0f} MiB is below the minimum for this model in "
            f"{mode} mode: {math.ceil(need / MiB):,} MiB (runtime floor {floor / MiB:,.0f} MiB, "
            f"resident weights {_resident_bytes(fp, 1.0, mode == 'dense') / MiB:,.0f} MiB, "
            "context "
            f"{n_ctx} tokens). Give --ram-budget {math.ceil(need / MiB)}M or more, or a "
            "smaller context (-c)."
        )
    L = fp.n_layers
    # What one layer's FFN costs a token on the CPU without a device: every byte read
    # from flash (dense streaming, the worst case) plus its compute.
    layer_ffn = fp.dense_ffn_bytes / L
    ffn_cost = dev.cpu_seconds(fp.ffn_formats()) / L + layer_ffn / dev.flash_rate(DENSE_READ_BYTES)
    ffn_l, att_l, gpu_used = _choose_gpu(fp, gpu_budget, dev, gpu_dtype_bytes, ffn_cost, gpu_force)
    L_cpu = L - len(ffn_l)
    att_share = 1 - len(att_l) / L
    kv = fp.kv_bytes(n_ctx)
    # dense streaming treats an untied head as one more matrix of rows (a share held,
    # the rest read every token), as its bytes cost the same per token as the FFN's
    head_streamed = mode == "dense" and fp.head_bytes > 0 and L_cpu > 0
    resident = _resident_bytes(fp, att_share, head_streamed)
    scratch = _ring_bytes() if mode == "dense" else _scratch_bytes(fp, prefetch)
    left = budget - floor - kv - resident - scratch
    notes: list[str] = []
    pinned = 0
    head_sketch = head_fixed = head_held_rows = tail = 0
    lent = 0  # of lent_bytes, what this plan streams (dense mode)
    gate_cpu = L_cpu * fp.d_ff * fp.gate_row_bytes
    if L_cpu == 0:
        per_layer, cache_bytes, read, compute_s = 0, 0, 0.0, 0.0
        gate_resident, pred, gate_b = True, 0, 0
    elif mode == "dense":
        # The paper's hybrid baseline: the first rows of every FFN matrix held (the same
        # share of each), the rest streamed every token in the file's format
        # (offload/rowstream.py), held rows a multiple of ROW_MULTIPLE.
        from edgerun.offload.head import sketch_bytes
        from edgerun.offload.rowstream import ROW_MULTIPLE

        sketched = head_streamed and head_candidates > 0 and fp.head_rows > 0
        # one neuron's share: its rows in every CPU layer, and vocab / d_ff head rows
        # where the head is streamed in the FFN's share (not sketched)
        head_share = fp.head_bytes / fp.d_ff if head_streamed and not sketched else 0
        nb = L_cpu * fp.dense_neuron_bytes + head_share
        room_ffn = left
        if sketched:
            # A token reads only its candidates of the head's flash rows, however many
            # are held: the held rows (the first, most used tokens) buy exactness, not
            # fewer reads. So the head holds a fixed count, measured for quality
            # (benchmarks/head_sketch_quality.py), and every other byte goes to FFN rows,
            # each of which saves its read every token.
            row_b = fp.head_bytes / fp.head_rows
            room = left - sketch_bytes(fp.head_rows, fp.d_model, head_rank)
            head_held_rows = min(fp.head_rows, head_held, max(0, int(room // row_b)))
            tail = fp.head_rows - head_held_rows
            head_sketch = sketch_bytes(tail, fp.d_model, head_rank) if tail else 0
            head_fixed = int(head_held_rows * row_b)
            room_ffn = max(0, left - head_fixed - head_sketch)
            resident += head_fixed + head_sketch
        fit = min(fp.d_ff, int(room_ffn // nb))
        per_layer = fit if fit >= fp.d_ff else fit - fit % ROW_MULTIPLE  # row multiples
        cache_bytes = int(per_layer * nb)
        read = (fp.d_ff - per_layer) * nb
        if per_layer < fp.d_ff:  # rows on loan are streamed rows a token does not read
            lent = int(min(max(0, lent_bytes), math.ceil(read)))
            read = max(0.0, read - lent)
        if sketched and tail:  # the head's other rows: the candidates, a 4 KiB read each
            read += head_candidates * 4096
        gate_resident, pred, gate_b = False, 0, 0
        compute_s = dev.cpu_seconds(fp.ffn_formats(), L_cpu / L)
        read_s = read / dev.stream_rate()
    else:
        gate_b = gate_cpu
        gate_resident = not allow_predictor or left - gate_b >= 0.1 * (
            left - fp.predictor_bytes(predictor_rank)
        )
        pred = 0 if gate_resident else fp.predictor_bytes(predictor_rank)
        left -= gate_b if gate_resident else pred
        slot = fp.record_bytes if gate_resident else fp.neuron_bytes
        per_layer = int(min(fp.d_ff, max(0, left) // (L_cpu * slot)))
        cache_bytes = per_layer * L_cpu * slot
        if frequencies is not None and hot_share > 0:
            pinned = int(hot_share * per_layer)
        freqs = None
        if frequencies is not None:
            cpu = [i for i in range(L) if i not in set(ffn_l)]
            freqs = [frequencies[i] for i in cpu]
        miss = _missed_fraction(per_layer, fp.d_ff, freqs, pinned)
        active = active_fraction * fp.d_ff * L_cpu
        layer_read, read_size = _sparse_read(
            active_fraction * fp.d_ff * miss, fp.d_ff, slot, gap_bytes
        )
        read = layer_read * L_cpu
        compute_s = active * _neuron_seconds(fp, dev, gate=not gate_resident)
        if offload is not None:
            misses = active_fraction * fp.d_ff * miss
            read_s = L_cpu * misses * offload.read_s(misses / fp.d_ff)
            compute_s = active * offload.neuron_compute_s
        if gate_resident:
            compute_s += gate_b / dev.cpu_rate(fp.gate_format)
        else:
            compute_s += pred / dev.cpu_rate()
        if not gate_resident:
            notes.append(
                f"gate rows do not fit beside a useful cache; a rank-{predictor_rank} "
                "predictor chooses the neurons"
            )
    if L_cpu == 0 or (offload is None and mode == "sparse"):
        chunk = DENSE_READ_BYTES if L_cpu == 0 else min(read_size, 1 << 20)
        read_s = read / dev.flash_rate(chunk)
    split = {
        "cpu": compute_s + _streamed_resident_seconds(fp, dev, att_share),
        "flash": read_s,
        "layers": L * dev.layer_overhead_s,
    }
    if mode == "dense" and L_cpu and per_layer < fp.d_ff:
        # one thread reads the streamed rows continuously, across layers and tokens,
        # while everything else computes: only what the reads take beyond it shows
        split["flash"] = max(0.0, read_s - split["cpu"] - split["layers"])
    if ffn_l or att_l:
        split["gpu"] = _gpu_time(fp, ffn_l, att_l, dev, gpu_dtype_bytes)
    t = sum(split.values())
    flash = fp.dense_ffn_bytes * L_cpu / L - cache_bytes - (gate_b if gate_resident else 0)
    flash += fp.head_bytes - head_fixed if head_streamed else 0
    return Plan(
        mode=mode,
        budget=budget,
        floor=floor,
        kv_bytes=kv,
        state_bytes=fp.state_bytes,
        resident_bytes=resident,
        gate_resident=gate_resident,
        predictor_bytes=pred,
        scratch_bytes=scratch,
        cache_neurons=per_layer,
        cache_bytes=cache_bytes,
        flash_bytes=max(0, int(flash)),
        read_bytes_per_token=float(read),
        predicted_tok_s=1.0 / t if t > 0 else float("inf"),
        active_fraction=active_fraction if mode == "sparse" else 1.0,
        notes=notes,
        gate_bytes=gate_b if gate_resident else 0,
        n_layers=L,
        d_ff=fp.d_ff,
        pinned_neurons=pinned,
        gpu_budget=gpu_budget,
        gpu_ffn_layers=ffn_l,
        gpu_attention_layers=att_l,
        gpu_bytes=gpu_used,
        time_split=split,
        head_streamed=head_streamed,
        head_candidates=head_candidates if head_sketch else 0,
        head_sketch_bytes=head_sketch,
        head_held_rows=head_held_rows,
        lent_bytes=lent,
    )


def footprint(spec, reader, kv_type: str = "f32", down_format: str = "Q8_0") -> Footprint:
    """Sizes of `spec`'s parts in `reader` (a GGUF or pack reader) for planning.

    The bundled record of a neuron is its up row in the file's format plus its
    down column requantized row-wise as `down_format`.
    """
    from edgerun.arch.spec import ATTENTION_ROLES
    from edgerun.model.kvcache import KVCache
    from edgerun.quant.formats import QuantType, row_bytes

    names = set(reader.tensor_names())
    size = {n: reader.tensor(n).nbytes for n in names}
    attn_extra = ("attn_q_bias", "attn_k_bias", "attn_v_bias", "attn_q_norm", "attn_k_norm")
    # Gemma 4's per-layer embedding gate and projection: matrices every token multiplies,
    # held with the attention (their table is a lookup: per_layer_table_bytes)
    attn_extra += tuple(r for r in ("ple_gate", "ple_proj") if r in spec.layer_tensors)
    # Gemma 3n's AltUp router and coefficients and Laurel's low-rank pair: the same
    attn_extra += tuple(
        r for r in ("altup_router", "altup_predict_coef", "altup_correct_coef", "laurel_l",
                    "laurel_r") if r in spec.layer_tensors
    )  # fmt: skip
    norm_roles = ("attn_norm", "ffn_norm", "post_attention_norm", "post_ffw_norm")
    norm_roles += tuple(
        r for r in ("ple_post_norm", "layer_output_scale", "altup_router_norm",
                    "altup_correct_scale", "laurel_post_norm") if r in spec.layer_tensors
    )  # fmt: skip
    attention = norms = dense_ffn = 0
    att_fmt: dict[str, int] = {}
    ffn_fmt: dict[str, int] = {}

    def fmt(name: str) -> str:
        return reader.tensor(name).qtype.name

    for i in spec.recurrent_layers:  # a recurrent mixer's tensors stay resident as attention
        for role in spec.layer_tensors:
            name = spec.layer_tensor(role, i)
            if role.startswith("ffn_") or role in norm_roles or name not in names:
                continue
            attention += size[name]
            att_fmt[fmt(name)] = att_fmt.get(fmt(name), 0) + size[name]
    for i in range(spec.n_layers):
        for role in ATTENTION_ROLES + attn_extra:
            name = spec.layer_tensor(role, i)
            if name in names:
                attention += size[name]
                att_fmt[fmt(name)] = att_fmt.get(fmt(name), 0) + size[name]
        for role in norm_roles:
            norms += size.get(spec.layer_tensor(role, i), 0)
        for role in ("ffn_gate", "ffn_up", "ffn_down"):
            name = spec.layer_tensor(role, i)
            if name in names:
                dense_ffn += size[name]
                ffn_fmt[fmt(name)] = ffn_fmt.get(fmt(name), 0) + size[name]
    g = spec.global_tensors
    embd = size.get(g["token_embd"], 0)
    head = size.get(g["output"], 0)
    norms += size.get(g["output_norm"], 0)
    per_layer_table = size.get(g.get("ple_token_embd", ""), 0)
    # resident beside the attention (Gemma 3n's AltUp projections too)
    for role in ("ple_model_proj", "ple_proj_norm", "altup_proj", "altup_unembd_proj"):
        name = g.get(role, "")
        if name in names:
            attention += size[name]
            att_fmt[fmt(name)] = att_fmt.get(fmt(name), 0) + size[name]
    attn_weights = 0
    for role in ATTENTION_ROLES:
        name = spec.layer_tensor(role, 0)
        if name in names:
            attn_weights += math.prod(reader.tensor(name).shape)
    moe = _moe_sizes(spec, reader, names, size)
    if moe:  # the planner sizes experts (experts_plan), not neurons: the first expert's rows
        gate_t = up_t = QuantType[moe["expert_format"]]
    else:
        gate_t = reader.tensor(spec.layer_tensor("ffn_gate", 0)).qtype
        up_t = reader.tensor(spec.layer_tensor("ffn_up", 0)).qtype
    record = row_bytes(up_t, spec.d_model) + row_bytes(QuantType[down_format], spec.d_model)
    return Footprint(
        n_layers=spec.n_layers,
        d_model=spec.d_model,
        d_ff=spec.d_ff,
        attention_bytes=attention,
        head_bytes=head,
        embedding_bytes=embd,
        norm_bytes=norms,
        gate_row_bytes=row_bytes(gate_t, spec.d_model),
        record_bytes=record,
        dense_ffn_bytes=dense_ffn,
        kv_bytes_per_token=KVCache.bytes_for(spec, 1, kv_type),
        state_bytes=KVCache.state_bytes(spec),
        attn_weights=attn_weights,
        attention_by_format=tuple(sorted(att_fmt.items())),
        ffn_by_format=tuple(sorted(ffn_fmt.items())),
        head_format=fmt(g["output"]) if g["output"] in names else fmt(g["token_embd"]),
        gate_format=gate_t.name,
        up_format=up_t.name,
        down_format=down_format,
        up_row_bytes=row_bytes(up_t, spec.d_model),
        head_rows=reader.tensor(g["output"]).shape[0] if head else 0,
        per_layer_table_bytes=per_layer_table,
        **moe,
    )


def _moe_sizes(spec, reader, names: set[str], size: dict[str, int]) -> dict:
    """A mixture-of-experts model's Footprint fields (empty for a dense model): one
    routed expert's bytes (its gate, up and down slices of the 3-D tensors), the counts,
    and what stays resident: the routers, bias and shared experts of every layer, and the
    FFNs of the dense layers a family keeps (LFM2-MoE's first ones)."""
    if not getattr(spec, "n_expert", 0):
        return {}
    routed = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
    kept = ("ffn_gate_inp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
    kept += ("ffn_gate_inp_shexp", "exp_probs_b", "ffn_gate_inp_scale", "ffn_down_exps_scale")
    resident = 0
    for i in range(spec.n_layers):
        resident += sum(size.get(spec.expert_tensor(r, i), 0) for r in kept)
        resident += sum(size.get(spec.layer_tensor(r, i), 0) for r in ("ffn_gate", "ffn_up",
                                                                         "ffn_down"))  # fmt: skip
    if any(spec.expert_tensor("ffn_gate_up_exps", i) in names for i in range(spec.n_layers)):
        routed = ("ffn_gate_up_exps", "ffn_down_exps")  # gate and up fused (Gemma 4)
    moe_layers = [i for i in range(spec.n_layers) if spec.expert_tensor(routed[0], i) in names]
    if not moe_layers:
        raise ModelFormatError(
            f"{getattr(reader, 'path', 'model')}: a mixture-of-experts model "
            f"({spec.n_expert} experts) without any '{routed[0]}' expert tensor"
        )
    first = [spec.expert_tensor(r, moe_layers[0]) for r in routed]
    return dict(
        expert_bytes=sum(size[n] for n in first if n in names) // spec.n_expert,
        n_expert=spec.n_expert,
        n_expert_used=spec.n_expert_used,
        moe_resident_bytes=resident,
        expert_format=reader.tensor(first[0]).qtype.name,
    )


# The expert cache holds at least this many layers' worth of a token's experts: the
# layer computing and the next one's prefetch.
MIN_EXPERT_LAYERS = 2


def _expert_staging_bytes() -> int:
    """The direct reader's staging buffers (expert reads that are not block aligned)."""
    from edgerun.offload.io import ALIGN, CHUNK, IO_THREADS

    return (IO_THREADS + 1) * (CHUNK + 2 * ALIGN)


def _expert_slot_bytes(fp: Footprint) -> int:
    """An expert's cache slot at most: its bytes, and for each of its three matrices
    the block boundaries its direct read is widened to (offload/experts.py)."""
    from edgerun.offload.io import ALIGN

    return -(-fp.expert_bytes // ALIGN) * ALIGN + 6 * ALIGN


def minimum_experts_budget(fp: Footprint, floor: int, n_ctx: int) -> int:
    """The smallest budget experts_plan accepts: everything but the routed experts, and
    a cache of MIN_EXPERT_LAYERS layers' experts."""

    slot = _expert_slot_bytes(fp)
    return (
        floor
        + fp.kv_bytes(n_ctx)
        + _resident_bytes(fp)
        + fp.moe_resident_bytes
        + _expert_staging_bytes()
        + MIN_EXPERT_LAYERS * fp.n_expert_used * slot
    )


def experts_plan(
    fp: Footprint,
    budget: int,
    floor: int,
    n_ctx: int,
    device: DeviceFigures | None = None,
    slot_bytes: int = 0,
    gpu_budget: int = 0,
    gpu_dtype_bytes: int = 2,
    gpu_force: bool = False,
) -> Plan:
    """A mixture-of-experts model under `budget`: attention, norms, head, embedding rows,
    routers and shared experts resident; every byte left is the expert cache
    (offload/experts.py), whole routed experts of `slot_bytes` each (default: the
    expert's bytes, each matrix aligned); a token reads the experts it is routed to
    that the cache misses.

    Predicted per token, with uniform routing (the worst case: the cache holds a
    uniform share of each layer's experts): reads = layers x experts used x expert bytes x
    missed share, at the flash rate of one expert matrix; compute = the resident
    part's plus the used experts'. Reads happen when the router has picked (a prefetch
    hides some; the prediction counts none), so they add to the compute. A GPU budget
    takes attention layers (_choose_gpu); their weights then leave RAM."""
    if not fp.n_expert:
        raise InvalidArgumentError("experts_plan needs a mixture-of-experts footprint")

    dev = device or DeviceFigures()
    need = minimum_experts_budget(fp, floor, n_ctx)
    if budget < need:
        raise BudgetError(
            f"RAM budget {budget / MiB:,.0f} MiB is below the minimum for this model with "
            f"its routed experts on flash: {math.ceil(need / MiB):,} MiB (runtime floor "
            f"{floor / MiB:,.0f} MiB, resident weights "
            f"{(_resident_bytes(fp) + fp.moe_resident_bytes) / MiB:,.0f} MiB, context "
            f"{n_ctx} tokens). Give --ram-budget {math.ceil(need / MiB)}M or more, or a "
            "smaller context (-c)."
        )
    L, E, k = fp.n_layers, fp.n_expert, fp.n_expert_used
    _, att_l, gpu_used = _choose_gpu(fp, gpu_budget, dev, gpu_dtype_bytes, 0.0, gpu_force)
    att_share = 1 - len(att_l) / L
    slot = slot_bytes or _expert_slot_bytes(fp)
    kv = fp.kv_bytes(n_ctx)
    resident = _resident_bytes(fp, att_share) + fp.moe_resident_bytes
    staging = _expert_staging_bytes()
    left = budget - floor - kv - resident - staging
    total = L * E
    slots = int(min(total, max(MIN_EXPERT_LAYERS * k, left // slot)))
    miss = 1.0 - slots / total
    read = L * k * fp.expert_bytes * miss
    expert_s = dev.cpu_seconds(((fp.expert_format, L * k * fp.expert_bytes),))
    shared_s = dev.cpu_seconds((("", fp.moe_resident_bytes),))
    split = {
        "cpu": expert_s + shared_s + _streamed_resident_seconds(fp, dev, att_share),
        "flash": read / dev.flash_rate(fp.expert_bytes // 3),
        "layers": L * dev.layer_overhead_s,
    }
    if att_l:
        split["gpu"] = _gpu_time(fp, (), att_l, dev, gpu_dtype_bytes)
    t = sum(split.values())
    notes = [
        f"routed experts: {L} layers x {E} of {fp.expert_bytes / MiB:,.2f} MiB, {k} a token "
        f"a layer; the cache holds {slots / total:.0%} of them (uniform routing misses "
        f"{miss:.0%}; skewed routing fewer)"
    ]
    return Plan(
        mode="experts",
        budget=budget,
        floor=floor,
        kv_bytes=kv,
        state_bytes=fp.state_bytes,
        resident_bytes=resident,
        gate_resident=True,
        predictor_bytes=0,
        scratch_bytes=staging,
        cache_neurons=0,
        cache_bytes=slots * slot,
        flash_bytes=max(0, (total - slots) * fp.expert_bytes),
        read_bytes_per_token=float(read),
        predicted_tok_s=1.0 / t if t > 0 else float("inf"),
        active_fraction=k / E,
        notes=notes,
        n_layers=L,
        d_ff=fp.d_ff,
        time_split=split,
        expert_slots=slots,
        experts_total=total,
        expert_bytes=fp.expert_bytes,
        gpu_budget=gpu_budget,
        gpu_attention_layers=att_l,
        gpu_bytes=gpu_used,
    )
