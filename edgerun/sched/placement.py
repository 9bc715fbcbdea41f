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
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from edgerun.errors import BudgetError, InvalidArgumentError

MiB = 1 << 20
# Embedding rows a long conversation touches, page-granular (4 KiB a distinct token).
EMBEDDING_TOUCH_BYTES = 16 * MiB
# Transient arrays of one forward step (logits, activations, staging buffers).
STEP_MARGIN_BYTES = 24 * MiB
# Cache misses are read and computed this many neurons at a time.
SCRATCH_NEURONS = 1024
# Prefetched records of the next layer wait in a staging matrix of this many neurons.
PREFETCH_NEURONS = 4096


def parse_budget(text: str | int, total_bytes: int | None = None) -> int:
    """'800M', '1.5G', '560MB', '60%' (of total_bytes, the machine's RAM) or bytes -> bytes."""
    if isinstance(text, int):
        if text <= 0:
            raise BudgetError(f"RAM budget must be positive, got {text}")
        return text
    s = str(text).strip()
    m = re.fullmatch(r"(?i)(\d+(?:\.\d+)?)\s*(%|[kmgt]i?b?|b)?", s)
    if not m:
        raise BudgetError(
            f"cannot read RAM budget {text!r}: expected a size like 800M, 1.5G or a "
            "percentage like 60%"
        )
    value, unit = float(m.group(1)), (m.group(2) or "b").lower()
    if unit == "%":
        if not 0 < value <= 100:
            raise BudgetError(f"RAM budget {text!r}: a percentage must be in (0, 100]")
        if total_bytes is None:
            import psutil

            total_bytes = int(psutil.virtual_memory().total)
        out = int(total_bytes * value / 100)
    else:
        scale = {"b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[unit[0]]
        out = int(value * scale)
    if out <= 0:
        raise BudgetError(f"RAM budget {text!r} is zero")
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

    @property
    def gate_bytes(self) -> int:
        return self.n_layers * self.d_ff * self.gate_row_bytes

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
    kv_bytes: int
    resident_bytes: int  # attention + norms + head + embedding rows + margins
    gate_resident: bool
    predictor_bytes: int
    scratch_bytes: int
    cache_neurons: int  # per layer
    cache_bytes: int
    flash_bytes: int  # what stays on flash
    read_bytes_per_token: float
    predicted_tok_s: float
    active_fraction: float
    gate_bytes: int = 0  # gate rows held in RAM (0 when they stay on flash)
    notes: list[str] = field(default_factory=list)

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

    def describe(self) -> str:
        mb = MiB
        rows = [
            ("RAM budget", f"{self.budget / mb:,.0f} MiB"),
            ("runtime floor (measured)", f"{self.floor / mb:,.0f} MiB"),
            ("KV cache", f"{self.kv_bytes / mb:,.0f} MiB"),
            (
                "resident: attention, norms, head, embeddings",
                f"{self.resident_bytes / mb:,.0f} MiB",
            ),  # noqa: E501
            (
                "gate rows",
                f"{self.gate_bytes / mb:,.0f} MiB in RAM" if self.gate_resident else "on flash",
            ),
            ("gate predictor", f"{self.predictor_bytes / mb:,.0f} MiB"),
            ("scratch for cache misses", f"{self.scratch_bytes / mb:,.0f} MiB"),
            (
                "neuron cache",
                f"{self.cache_bytes / mb:,.0f} MiB ({self.cache_neurons} neurons a layer)",
            ),
            ("stays on flash", f"{self.flash_bytes / mb:,.0f} MiB"),
            ("planned total", f"{self.used_bytes / mb:,.0f} MiB"),
            ("predicted read per token", f"{self.read_bytes_per_token / mb:,.1f} MiB"),
            ("predicted decode", f"{self.predicted_tok_s:,.1f} tok/s"),
        ]
        w = max(len(k) for k, _ in rows)
        head = "resident (no offloading)" if self.mode == "resident" else f"{self.mode} offloading"
        lines = [f"plan: {head}"] + [f"  {k:<{w}}  {v}" for k, v in rows]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


@dataclass(frozen=True)
class DeviceFigures:
    """Measured rates the prediction uses (defaults: this machine kind, PERF_NOTES)."""

    flash_read_bytes_s: float = 600e6  # O_DIRECT, 32-128 KiB reads, 4 threads
    ram_stream_bytes_s: float = 20e9  # what the kernels stream from DRAM


def _resident_bytes(fp: Footprint) -> int:
    return (
        fp.attention_bytes
        + fp.norm_bytes
        + fp.head_bytes
        + min(fp.embedding_bytes, EMBEDDING_TOUCH_BYTES)
        + STEP_MARGIN_BYTES
    )


def _scratch_bytes(fp: Footprint, prefetch: bool = False) -> int:
    """Neurons that miss the cache are read and computed in chunks of this many bytes;
    prefetching adds its staging matrix."""
    staged = min(fp.d_ff, PREFETCH_NEURONS) * fp.record_bytes if prefetch else 0
    # two chunks: one computing while the next is read
    return 2 * min(fp.d_ff, SCRATCH_NEURONS) * fp.neuron_bytes + staged


def _missed_fraction(cache_neurons: int, d_ff: int, frequencies=None) -> float:
    """Share of a token's active neurons the cache does not hold.

    With measured activation frequencies (per layer arrays), the cache is assumed to
    hold the most frequent neurons; without them every neuron is equally likely.
    """
    if d_ff == 0:
        return 0.0
    if frequencies is None:
        return max(0.0, 1.0 - cache_neurons / d_ff)
    miss = []
    for f in frequencies:
        total = float(sum(f)) or 1.0
        top = sorted(f, reverse=True)[:cache_neurons]
        miss.append(max(0.0, 1.0 - float(sum(top)) / total))
    return sum(miss) / len(miss)


def resident_plan(fp: Footprint, file_bytes: int, budget: int, floor: int, n_ctx: int):
    """A Plan that keeps the whole model resident (mmap) when it fits the budget with
    room to spare, or None. Measured: when it fits, the page cache serves the mmap
    faster than any streaming (Qwen2.5-Coder-0.5B in 839 MiB: 11.0 tok/s mmap, 9.0
    dense offload)."""
    kv = n_ctx * fp.kv_bytes_per_token
    need = floor + kv + file_bytes + STEP_MARGIN_BYTES
    if need > budget:
        return None
    return Plan(
        mode="resident",
        budget=budget,
        floor=floor,
        kv_bytes=kv,
        resident_bytes=file_bytes + STEP_MARGIN_BYTES,
        gate_resident=True,
        predictor_bytes=0,
        scratch_bytes=0,
        cache_neurons=fp.d_ff,
        cache_bytes=0,
        flash_bytes=0,
        read_bytes_per_token=0.0,
        predicted_tok_s=1.0 / ((file_bytes) / DeviceFigures().ram_stream_bytes_s),
        active_fraction=1.0,
        notes=["the whole model fits the budget: it stays resident (mmap), nothing streams"],
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
    """The smallest budget `plan` accepts for this model and mode."""
    base = floor + n_ctx * fp.kv_bytes_per_token + _resident_bytes(fp)
    scratch = _scratch_bytes(fp, prefetch and mode == "sparse")
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
) -> Plan:
    """Split `budget` bytes between resident weights, gate, predictor and neuron cache.

    active_fraction is the share of neurons a token needs (1 - sparsity) in sparse
    mode. Raises BudgetError naming the minimum when the budget cannot hold the
    mandatory parts.
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
            f"resident attention/head {_resident_bytes(fp) / MiB:,.0f} MiB, context "
            f"{n_ctx} tokens). Give --ram-budget {math.ceil(need / MiB)}M or more, or a "
            "smaller context (-c)."
        )
    kv = n_ctx * fp.kv_bytes_per_token
    resident = _resident_bytes(fp)
    scratch = _scratch_bytes(fp, prefetch and mode == "sparse")
    left = budget - floor - kv - resident - scratch
    notes: list[str] = []
    L = fp.n_layers
    if mode == "dense":
        # The paper's hybrid baseline: whole neurons held, the rest streamed every token.
        per_layer = min(fp.d_ff, left // (L * fp.neuron_bytes))
        cache_bytes = per_layer * L * fp.neuron_bytes
        read = (fp.d_ff - per_layer) * L * fp.neuron_bytes
        touched = fp.d_ff * L * fp.neuron_bytes
        gate_resident, pred, gate_b = False, 0, 0
    else:
        gate_b = fp.gate_bytes
        gate_resident = not allow_predictor or left - gate_b >= 0.1 * (
            left - fp.predictor_bytes(predictor_rank)
        )
        pred = 0 if gate_resident else fp.predictor_bytes(predictor_rank)
        left -= gate_b if gate_resident else pred
        slot = fp.record_bytes if gate_resident else fp.neuron_bytes
        per_layer = int(min(fp.d_ff, max(0, left) // (L * slot)))
        cache_bytes = per_layer * L * slot
        miss = _missed_fraction(per_layer, fp.d_ff, frequencies)
        active = active_fraction * fp.d_ff * L
        read = active * miss * slot
        touched = active * slot + (gate_b if gate_resident else pred)
        if not gate_resident:
            notes.append(
                f"gate rows do not fit beside a useful cache; a rank-{predictor_rank} "
                "predictor chooses the neurons"
            )
    t = read / dev.flash_read_bytes_s + (touched + resident) / dev.ram_stream_bytes_s
    flash = fp.dense_ffn_bytes - cache_bytes - (gate_b if gate_resident else 0)
    return Plan(
        mode=mode,
        budget=budget,
        floor=floor,
        kv_bytes=kv,
        resident_bytes=resident,
        gate_resident=gate_resident,
        predictor_bytes=pred,
        scratch_bytes=scratch,
        cache_neurons=per_layer,
        cache_bytes=cache_bytes,
        flash_bytes=max(0, flash),
        read_bytes_per_token=float(read),
        predicted_tok_s=1.0 / t if t > 0 else float("inf"),
        active_fraction=active_fraction if mode == "sparse" else 1.0,
        notes=notes,
        gate_bytes=gate_b if gate_resident else 0,
    )


def footprint(spec, reader, kv_type: str = "f32", down_format: str = "Q8_0") -> Footprint:
    """Sizes of `spec`'s parts in `reader` (a GGUF or pack reader) for planning.

    The bundled record of a neuron is its up row in the file's format plus its
    down column requantized row-wise as `down_format`.
    """
    from edgerun.quant.formats import QuantType, row_bytes

    names = set(reader.tensor_names())
    size = {n: reader.tensor(n).nbytes for n in names}
    attn_roles = ("attn_q", "attn_k", "attn_v", "attn_output")
    attn_extra = ("attn_q_bias", "attn_k_bias", "attn_v_bias", "attn_q_norm", "attn_k_norm")
    norm_roles = ("attn_norm", "ffn_norm", "post_attention_norm", "post_ffw_norm")
    attention = norms = dense_ffn = 0
    for i in range(spec.n_layers):
        for role in attn_roles + attn_extra:
            attention += size.get(spec.layer_tensor(role, i), 0)
        for role in norm_roles:
            norms += size.get(spec.layer_tensor(role, i), 0)
        for role in ("ffn_gate", "ffn_up", "ffn_down"):
            dense_ffn += size.get(spec.layer_tensor(role, i), 0)
    g = spec.global_tensors
    embd = size.get(g["token_embd"], 0)
    head = size.get(g["output"], 0)
    norms += size.get(g["output_norm"], 0)
    gate = reader.tensor(spec.layer_tensor("ffn_gate", 0))
    up = reader.tensor(spec.layer_tensor("ffn_up", 0))
    record = row_bytes(up.qtype, spec.d_model) + row_bytes(QuantType[down_format], spec.d_model)
    kv_item = 2 if kv_type == "f16" else 4
    return Footprint(
        n_layers=spec.n_layers,
        d_model=spec.d_model,
        d_ff=spec.d_ff,
        attention_bytes=attention,
        head_bytes=head,
        embedding_bytes=embd,
        norm_bytes=norms,
        gate_row_bytes=row_bytes(gate.qtype, spec.d_model),
        record_bytes=record,
        dense_ffn_bytes=dense_ffn,
        kv_bytes_per_token=spec.n_layers * 2 * spec.kv_dim * kv_item,
    )
