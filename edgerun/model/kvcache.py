"""Preallocated KV cache with prefix reuse.

Policy on overflow: the engine refuses a prompt that does not fit (a clear
ContextOverflowError) and ends generation with finish_reason "length" when
the window fills; nothing is silently dropped here.
"""

from __future__ import annotations

import math
import mmap
import threading

import numpy as np

from edgerun.arch.spec import ModelSpec
from edgerun.errors import ContextOverflowError, InvalidArgumentError, UnsupportedError
from edgerun.model.state_cache import StateCache
from edgerun.ops.attention import cache_floats, cache_values
from edgerun.ops.kv_blocks import row_width


def lazy_zeros(shape: tuple[int, ...], dtype: type) -> np.ndarray:
    """A zeroed array whose pages become resident only when written.

    np.zeros asks for transparent huge pages on large arrays, and the cache's
    [layer, head, position] layout means the first token writes into every 2 MiB
    huge page: the whole window would be resident after one token. Anonymous mmap
    with huge pages refused keeps resident memory proportional to the tokens held.
    """
    count = math.prod(shape)
    buf = mmap.mmap(-1, max(1, count * np.dtype(dtype).itemsize))
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(buf, dtype=dtype, count=count).reshape(shape)


def release_pages(a: np.ndarray) -> None:
    """Give back the memory of an array made by lazy_zeros: its pages become resident
    again only when written (their old contents are gone). The mapping is shared
    anonymous memory, which MADV_DONTNEED would leave in place: MADV_REMOVE frees it."""
    base = a
    while isinstance(base, np.ndarray):
        base = base.base
    buf = base.obj if isinstance(base, memoryview) else None
    if not isinstance(buf, mmap.mmap):
        raise InvalidArgumentError("release_pages: not an array made by lazy_zeros")
    advice = getattr(mmap, "MADV_REMOVE", getattr(mmap, "MADV_DONTNEED", None))
    if advice is not None:
        buf.madvise(advice)


PAGE_BYTES = 4096

# Element types a cache can hold. f16 halves the memory (llama.cpp's default cache
# type); it is stored as raw uint16 bits because Numba has no float16 on the CPU, and
# the attention kernel widens each value as it reads it. q8_0 and q4_0 hold ggml's
# 32-value blocks (ops/kv_blocks.py: int8 elements for q8_0, uint8 for q4_0), a row of
# head_dim / 32 blocks per position, which the kernels dequantise as they read them;
# those rows hold R x, x rotated by kv_blocks' fixed orthogonal transform.
KV_TYPES = {
    "f32": np.dtype(np.float32),
    "f16": np.dtype(np.uint16),
    "q8_0": np.dtype(np.int8),
    "q4_0": np.dtype(np.uint8),
}
QUANTISED_KV_TYPES = ("q8_0", "q4_0")

# What a saved session records of its key rows' centre (key_centre): a cache with
# quantised keys stores k - c, c the k bias on the pairs RoPE turns < pi / 3.
KEY_CENTRE = "k-bias-slow-rope/1"

# Token ids of the pass that sets the key scales (Transformer.key_scales): fixed
# pseudo-random ids (no tokenizer below the model; the scales follow the weights' per-channel
# magnitudes, which any text shows), as many as the pass needs for steady channel energies.
KEY_SCALE_TOKENS = 128
KEY_SCALE_SEED = 52
KEY_SCALE_LIMIT = 16  # |log2| of a key scale at most: a dead channel does not set one


def check_kv_type(kv_type: str) -> str:
    """A KV type as given: one type for keys and values ("q8_0"), or the keys' and the
    values' types apart, "K/V" ("q8_0/f16", llama.cpp's -ctk q8_0 -ctv f16)."""
    if not isinstance(kv_type, str):
        raise InvalidArgumentError(f"KV cache type must be a string, got {kv_type!r}")
    for t in kv_type.split("/", 1):
        if t not in KV_TYPES:
            raise InvalidArgumentError(
                f"unknown KV cache type {t!r}; expected one of {', '.join(KV_TYPES)} "
                "(or K/V types apart as 'K/V', e.g. 'q8_0/f16')"
            )
    return kv_type


def kv_types(kv_type: str) -> tuple[str, str]:
    """(keys' type, values' type) of a KV type (check_kv_type's spelling)."""
    parts = check_kv_type(kv_type).split("/", 1)
    return parts[0], parts[-1]


def kv_type_name(k_type: str, v_type: str | None = None) -> str:
    """The one KV type string for keys of k_type and values of v_type (default: the same)."""
    v_type = k_type if v_type is None else v_type
    return check_kv_type(k_type if k_type == v_type else f"{k_type}/{v_type}")


def kv_type_asked(
    kv_type: str | None, k_type: str | None = None, v_type: str | None = None
) -> str | None:
    """The KV type a caller asks for: kv_type for both (None: the runtime's default),
    k_type / v_type (llama.cpp's -ctk / -ctv) for one side; a side given alone leaves
    the other at kv_type, else at f16 (llama.cpp's default cache type)."""
    if k_type is None and v_type is None:
        return None if kv_type is None else check_kv_type(kv_type)
    k_def, v_def = kv_types(kv_type) if kv_type is not None else ("f16", "f16")
    return kv_type_name(k_type or k_def, v_type or v_def)


def row_bytes(kv_type: str, head_dim: int) -> int:
    """Bytes one (layer, KV head, position) row of keys or values of one type takes:
    head_dim elements of f32 / f16, head_dim / 32 blocks of q8_0 (34 bytes) / q4_0 (18)."""
    dtype = KV_TYPES[check_kv_type(kv_type)]
    return row_width(dtype, head_dim) * dtype.itemsize


def check_head_dim(kv_type: str, head_dim: int) -> None:
    """Quantised rows are whole 32-value blocks: refuse a head_dim they do not divide (as
    llama.cpp refuses a quantised cache type whose block size does not divide
    n_embd_head)."""
    for which, t in zip(("K", "V"), kv_types(kv_type)):
        if t in QUANTISED_KV_TYPES and head_dim % 32:
            raise UnsupportedError(
                f"{which} cache type {t} with block size 32 does not divide the model's "
                f"head_dim={head_dim}; use --cache-type-{which.lower()} f16 or f32"
            )


def key_centre(
    bias: np.ndarray, cos: np.ndarray, sin: np.ndarray, positions: int, neox: bool
) -> np.ndarray:
    """The part of a layer's k bias that stays constant under RoPE over `positions` (the
    trained context), float32 [kv_heads, head_dim]: RoPE at position 0 of the bias on
    each pair RoPE turns by less than pi / 3 over those positions and on the dims it does
    not turn, 0 on the other pairs. bias [kv_heads, head_dim]; cos, sin: the layer's RoPE
    tables (>= 2 positions; row 1 gives each pair's angle per position).

    Why: Qwen2.5's k bias reaches 354 on the pairs RoPE barely turns, an offset shared
    by every key of a layer and head that sets every 32-value block's scale, so q4_0
    keeps nothing of the rest (benchmarks/kv_key_outliers.py). A cache of quantised keys
    stores k - c instead: each query's scores move by the constant q . c, which the
    softmax removes exactly (without an attention softcap, whose tanh would not). Any c is
    exact; this one leaves each centred pair an offset |R(a) b - b| = 2 sin(a / 2) |b| <=
    |b| at every trained position (a < pi / 3), so no position keeps more than it would
    without the centre, and the early positions of a long context (a ~ 0) nearly none.
    The mean of RoPE_p(bias) over the positions does worse at the lengths chats reach
    (kv_key_outliers: it moves the centre toward angles only far positions take). It is
    known before any token, so every cache of a model holds the same."""
    theta = np.abs(np.arctan2(sin[1], cos[1]).astype(np.float64))
    slow = theta * float(positions) < np.pi / 3
    half = cos.shape[1]
    b = np.asarray(bias, np.float64)
    c = b.copy()  # the dims past the rotated ones stay constant
    i0 = np.arange(half) if neox else np.arange(0, 2 * half, 2)
    i1 = i0 + half if neox else i0 + 1
    for i in (i0, i1):  # RoPE at position 0: the tables' scale (cos[0]), no turn
        c[:, i] = np.where(slow, b[:, i] * cos[0].astype(np.float64), 0.0)
    return c.astype(np.float32)


def key_scale(q_energy: np.ndarray, k_energy: np.ndarray, neox: bool) -> np.ndarray:
    """A layer's key scales [kv_heads, head_dim] (float32 powers of two) from the mean
    square of its queries (grouped per KV head) and of its centred keys per channel,
    [kv_heads, head_dim] each.

    Why: a quantised key row keeps an error of about the same size in every channel (the
    rotation spreads it), and a score's error is q . e, so a channel where keys are large
    and queries small (or the reverse; Gemma 3's q and k norm weights reach 30x apart)
    wastes the blocks' resolution. The cache stores k / s and the query is multiplied by
    s, so q . k is unchanged; s = (E k^2 / E q^2)^(1/4) per channel makes the two sides'
    energies equal, which minimises |q s| |k / s| (Cauchy-Schwarz), the scale of every
    score's error (SmoothQuant's / QServe's SmoothAttention balance). Each RoPE pair takes
    one scale (RoPE mixes a pair's energy over positions), rounded to a power of two so
    (q s) . (k / s) equals q . k bit for bit in float arithmetic, and a scale computed on
    another machine's kernels lands on the same value."""
    hkv, hd = k_energy.shape
    half = hd // 2
    pairs = []
    for e in (np.asarray(q_energy, np.float64), np.asarray(k_energy, np.float64)):
        if neox:
            p = (e[:, :half] + e[:, half:]) / 2
            e = np.concatenate([p, p], 1)
        else:
            p = (e[:, 0::2] + e[:, 1::2]) / 2
            e = np.repeat(p, 2, axis=1)
        pairs.append(e)
    eq, ek = pairs
    tiny = 1e-30
    ratio = np.where((eq > tiny) & (ek > tiny), ek / np.maximum(eq, tiny), 1.0)
    exponent = np.clip(np.round(np.log2(ratio) / 4), -KEY_SCALE_LIMIT, KEY_SCALE_LIMIT)
    return np.exp2(exponent).astype(np.float32)


def group_scales(scale: np.ndarray, n_heads: int) -> np.ndarray:
    """[kv_heads, head_dim] key scales -> [n_heads, head_dim]: each query head takes its
    KV head's (grouped-query attention)."""
    return np.repeat(scale, n_heads // scale.shape[0], axis=0)


def written_slabs(spec: ModelSpec) -> int:
    """The (layer, KV head) slabs of [n_ctx, row] a cache writes: every one, but where
    layers differ (Gemma 4) only those of the layers storing their own KV, each of its
    own heads (a KV-shared layer's slab and a smaller layer's extra heads are never
    written, so their pages never become resident)."""
    if not getattr(spec, "layered", False):
        return len(spec.attention_layers) * spec.n_kv_heads
    return sum(spec.kv_heads_of(i) for i in range(spec.n_layers) if spec.kv_source(i) == i)


class KVCache:
    """Keys and values for every attention layer: [layers, kv_heads, n_ctx, row] of f32
    or f16 (row: head_dim values) or of q8_0 / q4_0 blocks (row: head_dim / 32 blocks'
    bytes), indexed by ModelSpec.kv_slot. kv_type: one type for both, or "K/V"
    (check_kv_type). `state`: the sequence's recurrent states (state_cache.py; empty for
    a model that only attends), which belong to the same tokens.

    key_centre: the model's key centres [attention layers, kv_heads, head_dim]
    (Transformer.key_centres; None: none); key_scale: its key scales, the same shape
    (Transformer.key_scales, powers of two; None: none). Both are kept only where the
    keys are q8_0 / q4_0, whose rows then hold (k - centre) / scale, rotated (kvcache's
    key_centre and key_scale say why), and whose queries are multiplied by the scale
    (scaled_queries, and every kernel that stores or attends on the cache). They belong to
    the cache: a cache built without them is never read with them. f16 and f32 keys are
    stored as they are, and their queries left as they are."""

    def __init__(
        self,
        spec: ModelSpec,
        n_ctx: int,
        kv_type: str = "f32",
        key_centre: np.ndarray | None = None,
        key_scale: np.ndarray | None = None,
    ) -> None:
        if n_ctx <= 0:
            raise ContextOverflowError(f"context size must be positive, got {n_ctx}")
        self.kv_type = check_kv_type(kv_type)
        self.k_type, self.v_type = kv_types(kv_type)
        # where layers differ in shape or share KV (Gemma 4; a spec-like object without
        # the per-layer fields has none): each layer's own view (layer())
        self.layered = bool(getattr(spec, "layered", False))
        for hd in set(getattr(spec, "layer_head_dims", ())) | {spec.head_dim}:
            check_head_dim(kv_type, hd)
        self.spec = spec
        arrays = []
        for t in (self.k_type, self.v_type):
            dtype = KV_TYPES[t]
            n_attn = len(spec.attention_layers)
            shape = (n_attn, spec.n_kv_heads, n_ctx, row_width(dtype, spec.head_dim))
            arrays.append(lazy_zeros(shape, dtype))
        self.k, self.v = arrays
        quantised = self.k_type in QUANTISED_KV_TYPES
        self.key_centre = key_centre if quantised and not self.layered else None
        # where layers differ in shape (Gemma 4) one [layers, kv_heads, head_dim] array
        # does not fit them: no scale there, as no centre
        self.key_scale = key_scale if quantised and not self.layered else None
        self.n_ctx = n_ctx
        self.tokens: list[int] = []  # ids whose keys/values are stored, in order
        self.written = 0  # positions written since the pages were last given back
        # Held by whoever moves the rows to disk and back (serving/kv_spill.py) or reads
        # them outside a forward pass (Session.save); `spilled` is the file holding them
        # while they are on disk (no forward pass may run on the cache then).
        self.lock = threading.RLock()
        self.spilled = None
        self.state = StateCache(spec)

    @staticmethod
    def bytes_for(spec: ModelSpec, n_ctx: int, kv_type: str = "f32") -> int:
        """Bytes a cache of n_ctx positions reserves (K and V)."""
        check_head_dim(kv_type, spec.head_dim)
        row = sum(row_bytes(t, spec.head_dim) for t in kv_types(kv_type))
        return written_slabs(spec) * n_ctx * row

    @staticmethod
    def state_bytes(spec: ModelSpec) -> int:
        """Bytes one sequence's recurrent states take, snapshots included (0 for a model
        that only attends); they do not grow with the context."""
        return StateCache.bytes_for(spec)

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @property
    def position_bytes(self) -> int:
        """Bytes one position takes (keys and values of every layer and head; where
        layers differ, of the (layer, head) slabs written: written_slabs)."""
        if self.layered:
            return self.bytes_for(self.spec, 1, self.kv_type)
        return self.nbytes // self.n_ctx

    @staticmethod
    def positions_per_page(spec: ModelSpec, kv_type: str) -> int:
        """Positions a 4 KiB page of one (layer, head)'s rows holds: 4096 / row bytes, of
        the wider of the keys' and the values' rows where their types differ."""
        row = max(row_bytes(t, spec.head_dim) for t in kv_types(kv_type))
        return max(1, PAGE_BYTES // row)

    def pages_for(self, positions: int) -> int:
        """positions rounded up to whole 4 KiB pages of the [layer, head, position] rows."""
        per_page = self.positions_per_page(self.spec, self.kv_type)
        return -(-positions // per_page) * per_page

    @property
    def resident_bytes(self) -> int:
        """Memory its written positions hold now (0 while spilled to disk)."""
        if self.spilled is not None:
            return 0
        return self.pages_for(max(self.written, self.length)) * self.position_bytes

    def mark_written(self, end: int) -> None:
        """Record a write of positions up to `end` made without store() (copied rows)."""
        self.written = max(self.written, int(end))

    def release(self) -> None:
        """Give every page back (the rows are gone; the spilled file, if any, is kept)."""
        release_pages(self.k)
        release_pages(self.v)
        self.written = 0

    def room(self) -> int:
        return self.n_ctx - self.length

    def check_fits(self, n_new: int) -> None:
        if self.spilled is not None:
            raise InvalidArgumentError(
                "this KV cache's rows are on disk (an idle session under a RAM budget); "
                "the scheduler reads them back before it computes on it"
            )
        if self.length + n_new > self.n_ctx:
            raise ContextOverflowError(
                f"{self.length + n_new} tokens do not fit in the context window of "
                f"{self.n_ctx} (already used {self.length}, adding {n_new}); "
                "use a larger context (-c / n_ctx) or a shorter prompt"
            )

    def store(self, layer: int, start: int, k: np.ndarray, v: np.ndarray) -> None:
        """k, v [n, kv_heads, head_dim] (float32) for positions start .. start + n - 1."""
        n = k.shape[0]
        if self.key_centre is not None:
            k = k - self.key_centre[layer]
        if self.key_scale is not None:  # powers of two: the division is exact
            k = k / self.key_scale[layer]
        k, v = cache_values(k, self.k.dtype), cache_values(v, self.v.dtype)
        if self.layered:  # the layer's own head count and head_dim (Gemma 4)
            dk, dv = self.layer(layer)
            dk[:, start : start + n] = k.transpose(1, 0, 2)
            dv[:, start : start + n] = v.transpose(1, 0, 2)
            self.written = max(self.written, start + n)
            return
        self.k[layer, :, start : start + n] = k.transpose(1, 0, 2)
        self.v[layer, :, start : start + n] = v.transpose(1, 0, 2)
        self.written = max(self.written, start + n)

    @property
    def key_centre_name(self) -> str:
        """What the key rows hold beyond the keys: KEY_CENTRE where they are centred,
        "none" where they are the keys themselves (a saved session records it)."""
        return "none" if self.key_centre is None else KEY_CENTRE

    def scaled_queries(self, layer: int, q: np.ndarray) -> np.ndarray:
        """Queries [n, heads, head_dim] of `layer` as scores against this cache's key rows
        take them: times the key scale (a new array), or q itself where keys are unscaled."""
        if self.key_scale is None:
            return q
        return q * group_scales(self.key_scale[layer], q.shape[1])

    @property
    def key_scale_exponents(self) -> list | None:
        """log2 of the key scales as nested lists of ints (what a saved session records;
        None: unscaled keys)."""
        if self.key_scale is None:
            return None
        return np.log2(self.key_scale).round().astype(np.int64).tolist()

    def key_floats(self, rows: np.ndarray, layer: int | slice) -> np.ndarray:
        """Key rows [..., kv_heads, positions, row] of `layer` (an index or a slice of
        layers, as rows were cut) of this cache as float32 keys: the rows' values times
        the scale and plus the centre they were stored less of."""
        k = cache_floats(rows, self.spec.head_dim)
        if self.key_scale is not None:
            k *= self.key_scale[layer][..., :, None, :]
        if self.key_centre is not None:
            k += self.key_centre[layer][..., :, None, :]
        return k

    def layer(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Layer i's keys and values [kv_heads, n_ctx, row] as its attention reads them:
        the rows of the layer whose KV it shares (spec.kv_source), cut to its own head
        count and head_dim where layers differ (the cache holds the largest of each, so a
        smaller layer's rows are views into it, and a KV-shared layer's slab is never
        written, so it takes no memory)."""
        if not self.layered:
            return self.k[i], self.v[i]
        s = self.spec
        src = s.kv_source(i)
        kvh, hd = s.kv_heads_of(i), s.head_dim_of(i)
        k = self.k[src, :kvh, :, : row_width(self.k.dtype, hd)]
        v = self.v[src, :kvh, :, : row_width(self.v.dtype, hd)]
        return k, v

    def common_prefix(self, ids: list[int]) -> int:
        """How many leading ids are already cached (reusable without recompute)."""
        n = 0
        for a, b in zip(self.tokens, ids):
            if a != b:
                break
            n += 1
        return n

    def reusable(self, n: int) -> int:
        """The most of the first n cached tokens a truncate can keep: n itself, unless
        recurrent states (which cannot be cut back) hold no state there: then the
        longest of the cache's length and its snapshots' positions at most n, else 0."""
        n = min(n, self.length)
        if not self.state.recurrent or n == self.length:
            return n
        return max((p for p in self.state.positions() if p <= n), default=0)

    def states_at(self, n: int) -> dict | None:
        """A copy of the recurrent states after the first n tokens (StateCache.copy_at);
        None where they are not kept."""
        return self.state.copy_at(n, self.length)

    def truncate(self, n: int) -> None:
        """Forget everything after the first n tokens (with recurrent states: n must be
        0, the length, or a kept position; reusable(n) gives one)."""
        if n < self.length and self.state.recurrent:
            if n == 0:
                self.state.reset()
            else:
                self.state.restore(n)
        del self.tokens[n:]

    def clear(self) -> None:
        """Forget everything and give the pages back (a new chat starts from nothing)."""
        with self.lock:
            self.tokens.clear()
            self.state.reset()
            if self.spilled is not None:
                self.spilled.close()
                self.spilled = None
            if self.written:
                self.release()
