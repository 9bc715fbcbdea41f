"""Weight stores with attention, norms, embeddings and head resident; FFNs from flash.

Both are ResidentStores whose `ffn()` returns a flash executor, sized by a placement
Plan (offload/plan.py):
- `DenseStreamStore` (dense plans): every FFN matrix keeps its first rows in RAM and
  streams the rest from the GGUF itself (offload/rowstream.py); nothing to prepare.
- `OffloadStore` (sparse plans): the bundled layout and CATS thresholds
  (offload/ffn.py). The bundle and the sparsity calibration are made once per source
  file and kept in the cache directory (`prepare`).

Calibration (CATS thresholds) runs the resident model over calibration text in
prefill chunks: one pass over the weights per chunk, so it stays cheap even when the
file is larger than RAM (clean mmap pages are reclaimed). It stores the quantiles of
|act(gate x)| per layer at every 5% of sparsity, so any target can be looked up.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from edgerun.arch.spec import ModelSpec
from edgerun.errors import InvalidArgumentError, ModelFormatError, UnsupportedError
from edgerun.model.ffn import FFNExecutor
from edgerun.model.weights import ResidentStore
from edgerun.offload.bundle import Bundle, ensure_bundle
from edgerun.offload.cache import NeuronCache
from edgerun.offload.ffn import OffloadStats, SparseFFN
from edgerun.offload.head import HEAD_CANDIDATES, HEAD_HELD_ROWS, HEAD_RANK
from edgerun.offload.io import IO_THREADS, aligned_empty
from edgerun.offload.plan import PREFETCH_NEURONS, SCRATCH_NEURONS, Plan
from edgerun.offload.prefetch import Prefetcher

if TYPE_CHECKING:
    from edgerun.offload.rowstream import SplitMatrix

__all__ = ["OffloadOptions", "OffloadStore", "prepare", "Calibration"]

# Measured (teacher-forced argmax agreement with the resident model over 512 tokens,
# edgerun.offload.sparsity.sparse_quality): SmolLM2-135M 95.7%, Qwen2.5-Coder-0.5B 97.1%
# at 0.10; at 0.20 they fall to 92.0% / ~94%, at 0.50 to 70.9% / 76.8%. These small
# SwiGLU models are not CATS-sparse at the quality the runtime promises.
DEFAULT_SPARSITY = 0.1
QUANTILES = np.round(np.arange(0.0, 1.0, 0.05), 2)
CALIB_TOKENS = 512


@dataclass
class OffloadOptions:
    """How the FFN is offloaded; the defaults are the measured best."""

    sparsity: float = DEFAULT_SPARSITY  # share of neurons skipped per token (0: dense)
    window: int = 5  # tokens a neuron stays cached after its last use (0: no cache)
    # Read the next layer's likely neurons (the last token's) while this one computes.
    # Off by default: measured on Qwen2.5-Coder-1.5B at 800 MiB, 10% sparsity, it read
    # 747 instead of 600 MB a token (mispredicted neurons) and ran 0.54 vs 0.60 tok/s.
    prefetch: bool = False
    io_threads: int = IO_THREADS
    gap_bytes: int = 32768
    # Share of each layer's neuron cache pinned with the hottest neurons of a profile
    # (`edgerun profile`, PowerInfer's hot set); the rest is the window. Used only when
    # a profile exists; 0 turns the split off. Measured in a memory cgroup of the budget
    # (benchmarks/offload.py, 2 runs each, results/hotcold.txt): Qwen2.5-Coder-1.5B at
    # 800 MiB 0.66 tok/s all pinned, 0.45-0.49 half, 0.45 window only (reads 627 vs 603
    # MB a token: no power law to exploit, but a static set pays under memory pressure);
    # Qwen2.5-Coder-0.5B at 560 MiB 1.84 / 2.12 / 1.84.
    hot: float = 1.0
    profile: str | None = None  # a profile file; default: the model's saved one, if any
    # Dense mode: plan the FFN rows the memory of LLVM's pages holds once the kernels
    # are loaded (they are paged out then), and read those rows after the warm-up.
    hold_after_warm_up: bool = True
    # Dense mode: lend the memory the budget reserves but the process is not using yet
    # (the KV cache's unwritten pages, the prompt step's temporaries, the plan's margins)
    # to streamed rows, in at most these many tiers given back before it is needed
    # (offload/kv_loan.py); 0: off. Measured on Qwen2.5-Coder-1.5B (context 512, Xeon,
    # cgroups of the budget + 5%, medians of 3 alternating): at 800 MiB 232 instead of
    # 276 MB read a token, 6.24 against 5.55 tok/s, peak 779 against 777 MB of 839; at
    # 560 MiB 481 / 520 MB, 3.34 / 3.16 tok/s, peak 530 / 530 MB of 587
    # (results/offload_1.5b_xeon_s32.txt). Session 20's version lent only the KV
    # reserve, and a third part of a Q6_K matrix loaded a kernel the warm-up had not
    # (76 MB of LLVM pages back): it ran no faster, so it was off by default.
    kv_loan_tiers: int = 4
    # Dense mode, an untied head: the head rows not held stay on flash, and a rank-
    # head_rank sketch of them picks this many a sequence and token to read exactly
    # (offload/head.py); 0 streams them all every token (exactly the resident logits).
    head_candidates: int = HEAD_CANDIDATES
    head_rank: int = HEAD_RANK
    # ... and its first rows held exactly (the tokens text uses most; fewer if the budget
    # leaves less): a fixed count, chosen by measured agreement (offload/head.py)
    head_held: int = HEAD_HELD_ROWS
    # Experts mode (a mixture of experts, offload/experts.py): read the likely experts of
    # this many next layers (their routers applied to this layer's input) while this one
    # computes; 0: none
    prefetch_layers: int = 2

    @classmethod
    def from_dict(cls, d: dict | None) -> OffloadOptions:
        d = dict(d or {})
        bad = set(d) - set(cls.__dataclass_fields__)
        if bad:
            raise InvalidArgumentError(
                f"unknown offload option(s) {sorted(bad)}; "
                f"known: {sorted(cls.__dataclass_fields__)}"
            )
        o = cls(**d)
        if not 0.0 <= o.sparsity < 1.0:
            raise InvalidArgumentError(f"offload sparsity must be in [0, 1), got {o.sparsity}")
        if o.window < 0:
            raise InvalidArgumentError(f"offload window must be >= 0 tokens, got {o.window}")
        if not 0 <= o.kv_loan_tiers <= 64:
            raise InvalidArgumentError(
                f"offload kv_loan_tiers must be in [0, 64], got {o.kv_loan_tiers}"
            )
        if not 0 <= o.prefetch_layers <= 64:
            raise InvalidArgumentError(
                f"offload prefetch_layers must be in [0, 64], got {o.prefetch_layers}"
            )
        if o.head_candidates < 0:
            raise InvalidArgumentError(
                f"offload head_candidates must be >= 0, got {o.head_candidates}"
            )
        if o.head_held < 0:
            raise InvalidArgumentError(f"offload head_held must be >= 0, got {o.head_held}")
        if not 1 <= o.head_rank <= 1024:
            raise InvalidArgumentError(f"offload head_rank must be in [1, 1024], got {o.head_rank}")
        if not 0.0 <= o.hot <= 1.0:
            raise InvalidArgumentError(f"offload hot share must be in [0, 1], got {o.hot}")
        return o


@dataclass
class Calibration:
    """Per-layer quantiles of |act(gate x)| (rows: QUANTILES)."""

    quantiles: np.ndarray  # float32 [len(QUANTILES), n_layers]

    def thresholds(self, sparsity: float) -> np.ndarray:
        if sparsity <= 0:
            return np.zeros(self.quantiles.shape[1], np.float32)
        k = int(np.argmin(np.abs(QUANTILES - sparsity)))
        return self.quantiles[k].astype(np.float32)


def _calibration_path(bundle: Path) -> Path:
    return bundle.with_suffix(".calib.npz")


def calibrate(
    transformer,
    tokenizer,
    n_tokens: int = CALIB_TOKENS,
    chunk: int = 128,
    kv_type: str = "f32",
    step: int | None = None,
) -> Calibration:
    """Quantiles of |act(gate x)| per layer over calibration text, on a resident
    Transformer (its text encoded by `tokenizer`; KV cache `kv_type`, forward calls of at
    most `step` tokens: the prompt chunk a budget allows)."""
    from edgerun.corpus import calibration_text
    from edgerun.offload.sparsity import collect_activations

    ids = tokenizer.encode(calibration_text())[:n_tokens]
    rec = collect_activations(
        transformer, ids, keep_x=False, chunk=chunk, kv_type=kv_type, step=step
    )
    n = len(transformer.layers)
    q = np.zeros((len(QUANTILES), n), np.float32)
    for i in range(n):
        s = rec.layer_score(i).astype(np.float32).reshape(-1)
        q[:, i] = np.quantile(s, QUANTILES)
    return Calibration(q)


def prepare(
    model_path: str | os.PathLike,
    file,
    transformer,
    tokenizer,
    sha256: str | None = None,
    progress: bool = True,
    kv_type: str = "f32",
    step: int | None = None,
) -> tuple[Path, Calibration]:
    """The bundle and calibration of the GGUF at `model_path` (opened as `file`, its
    resident Transformer and tokenizer calibrate), made once and cached."""
    path = ensure_bundle(model_path, sha256=sha256, progress=progress)
    cpath = _calibration_path(path)
    if cpath.exists():
        try:
            with np.load(cpath, allow_pickle=False) as z:
                return path, Calibration(np.asarray(z["quantiles"], np.float32))
        except (OSError, KeyError, ValueError):
            cpath.unlink(missing_ok=True)
    cal = calibrate(transformer, tokenizer, kv_type=kv_type, step=step)
    release_file_pages(file)
    tmp = cpath.with_suffix(".tmp.npz")
    np.savez(tmp, quantiles=cal.quantiles)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, cpath)
    return path, cal


def release_file_pages(gguf) -> None:
    """Drop a mapped GGUF's pages from RSS and the page cache (after calibration read it
    all), so the budget starts from the floor; views refault what they touch."""
    import mmap

    buf = getattr(gguf, "_buf", None)
    if isinstance(buf, mmap.mmap) and hasattr(buf, "madvise"):
        buf.madvise(mmap.MADV_DONTNEED)
    if hasattr(os, "posix_fadvise"):
        fd = os.open(gguf.path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _chain(ffns: list, ffn, last: bool) -> None:
    """Append a layer's executor: each one reads ahead for the next, the last layer's
    for layer 0 of the next token."""
    if ffns:
        ffns[-1].next = ffn
    ffns.append(ffn)
    if last:
        ffn.next = ffns[0]


class OffloadStore(ResidentStore):
    """Resident attention/head/embeddings; FFNs computed from a flash bundle."""

    def __init__(
        self,
        reader,
        source: str,
        spec: ModelSpec,
        bundle_path: Path,
        calibration: Calibration,
        plan: Plan,
        options: OffloadOptions,
        hot_order: list[np.ndarray] | None = None,
    ) -> None:
        from edgerun.offload.io import DirectReader

        self._tensor_reader = DirectReader(reader.path, threads=options.io_threads)
        super().__init__(_direct_tensors(reader, spec, self._tensor_reader), source)
        self.plan, self.options = plan, options
        # per layer: neuron ids, most active first (a NeuronProfile's hot_order)
        self.hot_order = hot_order
        self.pinned = 0  # neurons pinned over all layers
        self.bundle = Bundle(bundle_path, threads=options.io_threads, gap_bytes=options.gap_bytes)
        if self.bundle.layers != list(range(spec.n_layers)):
            raise ModelFormatError(f"{bundle_path}: bundle does not hold every layer of {source}")
        self.stats = OffloadStats()
        ly0 = self.bundle.layer(0)
        chunk = min(spec.d_ff, SCRATCH_NEURONS)
        self.scratch = aligned_empty(chunk * ly0.record_bytes).reshape(chunk, ly0.record_bytes)
        self.thresholds = calibration.thresholds(options.sparsity)
        if plan.mode != "sparse":
            raise InvalidArgumentError(
                f"OffloadStore computes sparse plans; a {plan.mode} plan takes DenseStreamStore"
            )
        self._chunk = chunk
        self.caches: list[NeuronCache] = []
        self._ffns: list[SparseFFN] = []
        self.prefetcher = None
        if options.prefetch and plan.mode == "sparse":
            self.prefetcher = Prefetcher(
                self.bundle, min(spec.d_ff, PREFETCH_NEURONS), ly0.record_bytes
            )

    def ffn(self, spec: ModelSpec, layer: int) -> FFNExecutor:
        self.check_vectors(spec, layer)  # as ResidentStore.ffn: norms against the spec
        if spec.ffn_sparsity_of(layer) is not None:  # its predictor skips other neurons
            raise UnsupportedError(
                f"{self._source}: layer {layer}'s FFN cuts its gate by its own statistics "
                "(Gemma 3n's activation sparsity), which the sparse offload plan does not "
                "compute; run it resident or under a dense streaming plan"
            )
        p, o = self.plan, self.options
        from edgerun.quant.formats import QuantTensor

        ly = self.bundle.layer(layer)
        gate = QuantTensor(
            spec.layer_tensor("ffn_gate", layer),
            ly.gate_format,
            (ly.d_ff, ly.d_model),
            np.ascontiguousarray(self.bundle.gate_rows(layer)),
        )
        cache = None
        if o.window > 0 and p.cache_neurons > 0:
            cache = NeuronCache(
                ly.d_ff, p.cache_neurons, {"record": ly.record_bytes}, window=o.window
            )
            self.caches.append(cache)
            self._pin_hot(cache, layer)
        ffn = SparseFFN(
            self.bundle,
            layer,
            gate,
            float(self.thresholds[layer]),
            spec.activation,
            cache,
            self.scratch,
            self.stats,
            self.prefetcher,
        )
        _chain(self._ffns, ffn, layer == spec.n_layers - 1)
        return ffn

    def _pin_hot(self, cache: NeuronCache, layer: int) -> None:
        """Pin the profile's hottest neurons of `layer` into `cache` (read once, here)."""
        if self.hot_order is None or self.options.hot <= 0 or self.options.window <= 0:
            return
        n = int(self.options.hot * cache.capacity)
        if n <= 0:
            return
        ids = np.sort(np.asarray(self.hot_order[layer][:n], np.int64))
        missing, _ = cache.pin(ids)
        missing = np.sort(missing)
        if missing.size:
            slots = cache.id_to_slot[missing]
            for c0 in range(0, missing.size, self._chunk):
                m = missing[c0 : c0 + self._chunk].astype(np.int32)
                buf = self.scratch[: m.size]
                self.bundle.read_records(layer, m, out=buf)
                cache.parts["record"][slots[c0 : c0 + m.size]] = buf
        self.pinned += int(ids.size)

    @property
    def flash_reader(self):
        """The DirectReader all flash reads go through."""
        return self.bundle.reader

    def offload_stats(self) -> dict:
        r = self.bundle.reader
        hits = sum(c.stats.hits for c in self.caches)
        misses = sum(c.stats.misses for c in self.caches)
        return {
            "bytes_read": int(r.bytes_read),
            "read_s": r.read_seconds,
            "io_s": self.stats.io_s,
            "mm_s": self.stats.mm_s,
            "compute_s": self.stats.compute_s,
            "hit_rate": hits / (hits + misses) if hits + misses else float("nan"),
            "active_fraction": self.stats.active / self.stats.neurons if self.stats.neurons else 0,
            "plan": self.plan.describe(),
            "pinned": self.pinned,
            "prefetch_hits": self.prefetcher.hits if self.prefetcher else 0,
            "prefetch_wasted": self.prefetcher.wasted if self.prefetcher else 0,
        }

    def reset_offload_stats(self) -> None:
        self.bundle.reader.reset_stats()
        self.stats.reset()  # pinning reads at load are not a token's
        if self.prefetcher is not None:
            self.prefetcher.hits = self.prefetcher.wasted = 0
        for c in self.caches:
            c.stats.hits = c.stats.misses = c.stats.evictions = 0


class DirectTensors:
    """A GGUF's tensors for a store under a RAM budget: each read once with direct I/O
    into anonymous memory, so the mmap is never faulted.

    Why: a fault on a mapped GGUF reads the device's readahead window around it
    (`read_ahead_kb`, 8 MiB on this machine kind), so touching a norm vector or an
    attention matrix pulled megabytes of the neighbouring FFN matrices into the page
    cache: measured on Qwen2.5-Coder-1.5B, 556 MiB of page cache after warm-up, 300 MiB
    of it FFN rows the stream reads anyway, pushing a cgroup of the budget into reclaim.
    The token embedding is the exception: only the rows a conversation uses are read,
    from the mapping, with readahead turned off for its range (MADV_RANDOM)."""

    def __init__(self, gguf, direct, mapped: frozenset[str] = frozenset()) -> None:
        self.gguf, self.direct, self.mapped = gguf, direct, mapped
        self.path, self.infos = gguf.path, gguf.infos
        import mmap

        buf = getattr(gguf, "_buf", None)
        if isinstance(buf, mmap.mmap) and hasattr(mmap, "MADV_RANDOM"):
            for name in mapped & set(gguf.infos):
                t = gguf.tensor(name)
                a = gguf.infos[name].offset // mmap.PAGESIZE * mmap.PAGESIZE
                end = gguf.infos[name].offset + t.data.nbytes
                buf.madvise(mmap.MADV_RANDOM, a, end - a)

    def tensor_names(self) -> list[str]:
        return self.gguf.tensor_names()

    def view(self, name: str):
        """The mapped view (never read through here)."""
        return self.gguf.tensor(name)

    def tensor(self, name: str):
        from edgerun.quant.formats import QuantTensor

        t = self.gguf.tensor(name)  # checks the name, type and extent
        if name in self.mapped:
            return t
        data = np.empty(t.data.shape, np.uint8)
        self.direct.read_into([(self.infos[name].offset, t.data.nbytes)], data)
        data.flags.writeable = False  # as mapped weights are: the kernels' cached types
        return QuantTensor(t.name, t.qtype, t.shape, data)


def _direct_tensors(
    gguf, spec: ModelSpec, direct, also_mapped: frozenset[str] = frozenset()
) -> DirectTensors:
    """also_mapped: tensors left mapped, not read into RAM (those a GPU placement moves
    off: it reads them once from the mapping, whose pages are then let go)."""
    g = spec.global_tensors
    # the embedding stays mapped (rows read as used) unless it is also the head
    mapped = frozenset({g["token_embd"]}) if g["output"] in gguf.infos else frozenset()
    mapped |= also_mapped
    # Gemma 4's per-layer embedding table too: a lookup (~40% of an E2B file) whose rows a
    # token reads, never the whole table (the planner counts its touched rows)
    if g.get("ple_token_embd") in gguf.infos:
        mapped |= {g["ple_token_embd"]}
    return DirectTensors(gguf, direct, mapped)


@dataclass
class RowLoan:
    """Rows one DenseStreamStore._hold added: their bytes, and what to go back to."""

    nbytes: int
    neurons_before: int
    kept: list[int]  # per split matrix, its `more` entries before the loan


class DenseStreamStore(ResidentStore):
    """Resident attention/embeddings; each FFN matrix, and the output head where the plan
    says so (an untied head: `Plan.head_streamed`), keeps its first rows in RAM and
    streams the rest every token in the file's own format (offload/rowstream.py). Needs
    no bundle and no calibration, and computes exactly what the resident model does.

    The plan's `cache_neurons` per layer sets the share of every FFN matrix held:
    gate and up rows [0, cache_neurons), down rows [0, cache_neurons / d_ff * d_model).
    The plan's `deferred_neurons` of those stay on flash until hold_more() (once the
    kernels are loaded and LLVM's pages are given back). Layers in `skip` (moved to a
    GPU afterwards) stream nothing."""

    def __init__(
        self,
        reader,
        source: str,
        spec: ModelSpec,
        plan: Plan,
        options: OffloadOptions,
        skip: frozenset[int] = frozenset(),
    ) -> None:
        from edgerun.offload.io import DirectReader
        from edgerun.offload.rowstream import RowStream, StreamStats

        self.direct = DirectReader(reader.path, threads=options.io_threads)
        super().__init__(_direct_tensors(reader, spec, self.direct), source)
        self.plan, self.options = plan, options
        self.spec = spec
        self.skip = skip
        self.row_stream = RowStream(self.direct)
        self.stats = StreamStats()
        # neurons held a layer now; hold_more() raises it up to the plan's cache_neurons
        self.held_neurons = max(0, plan.cache_neurons - plan.deferred_neurons)
        self._splits: list[tuple[SplitMatrix, int]] = []  # (matrix, file offset), in stream order
        self._loans: list[RowLoan] = []  # rows held past the first ones, newest last
        self._unstreamed: set[str] = set()  # split matrices whose other rows stay on flash

    def row_reader(self, name: str):
        """Rows of a lookup table (Gemma 4's per-layer embeddings) read from storage with
        direct I/O as tokens need them, never through the page cache: a function of ids
        giving a QuantTensor of those rows, in order."""
        from edgerun.quant.formats import QuantTensor

        t = self._reader.view(name)
        offset = self._reader.infos[name].offset
        row = t.data.shape[1]

        def read(ids: np.ndarray) -> QuantTensor:
            ids = np.asarray(ids, np.int64).reshape(-1)
            if ids.size and (ids.min() < 0 or ids.max() >= t.rows):
                raise InvalidArgumentError(f"{name}: row ids outside 0..{t.rows - 1}")
            buf = np.empty((ids.size, row), np.uint8)
            self.direct.read_into([(offset + int(i) * row, row) for i in ids], buf)
            return QuantTensor(name, t.qtype, (int(ids.size), t.cols), buf)

        return read

    def hold_more(self, max_bytes: int) -> int:
        """Hold up to max_bytes more of every streamed FFN matrix's first rows in RAM, the
        same share of each, at most up to the plan's cache_neurons; the stream is rebuilt
        over the rows left. Returns the bytes read into RAM."""
        if self._loans:
            raise InvalidArgumentError("hold_more() with row loans outstanding: repay them first")
        held = self._hold(min(self.spec.d_ff, self.plan.cache_neurons), max_bytes, exact=False)
        return 0 if held is None else held.nbytes

    def lend(self, max_bytes: int) -> RowLoan | None:
        """Hold up to max_bytes more rows as hold_more does, past the plan's share (memory
        the caller vouches for: offload/kv_loan.py), until repay(); None if no row more
        fits (all held, or less than one row multiple's worth)."""
        loan = self._hold(self.spec.d_ff, max_bytes, exact=True)
        if loan is not None:
            self._loans.append(loan)
        return loan

    def repay(self, loan: RowLoan) -> None:
        """Give back the newest loan's rows (loans are repaid newest first): they stream
        again, and their buffer is freed."""
        if not self._loans or self._loans[-1] is not loan:
            raise InvalidArgumentError("row loans are repaid newest first")
        self._loans.pop()
        for (m, _), keep in zip(self._splits, loan.kept, strict=True):
            m.detach(keep)
        self._restream()
        self.held_neurons = loan.neurons_before

    @staticmethod
    def loan_bytes(loan: RowLoan) -> int:
        return loan.nbytes

    def _hold(self, limit: int, max_bytes: int, exact: bool) -> RowLoan | None:
        """Raise the rows held to `limit` neurons' share at most, read into one buffer
        (freed whole when the loan is repaid): max_bytes of rows at most (exact), or
        max_bytes' worth of neurons at the plan's average bytes a neuron."""
        spec = self.spec
        if limit <= self.held_neurons or max_bytes <= 0 or not self._splits:
            return None

        def spans_for(neurons: int) -> list[tuple]:  # (matrix, first row, end row, bytes)
            out = []
            for m, _ in self._splits:
                r0 = m.held_rows
                share = m.hold_end(self._share_rows(neurons, m.rows))
                r1 = r0 if self._fixed(m) else max(r0, share)
                out.append((m, r0, r1, (r1 - r0) * m.template.data.shape[1]))
            return out

        if exact:  # the most neurons whose rows (rounded to row multiples) fit max_bytes
            lo, hi = self.held_neurons, min(limit, spec.d_ff)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if sum(sp[3] for sp in spans_for(mid)) <= max_bytes:
                    lo = mid
                else:
                    hi = mid - 1
            want = lo
        else:  # the plan's count: a neuron's share at its average bytes (the plan's sum
            # holds the rows that rounding left out of the earlier share)
            per_neuron = sum(
                m.template.data.shape[1] * m.rows / spec.d_ff
                for m, _ in self._splits
                if not self._fixed(m)
            )
            want = min(limit, self.held_neurons + int(max_bytes // per_neuron))
        spans = spans_for(want)
        sizes = [sp[3] for sp in spans]
        if want <= self.held_neurons or not sum(sizes):
            return None
        buf = np.empty(sum(sizes), np.uint8)  # one mapping: freed whole on repay
        at = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64).tolist()
        reads = [
            ((offset + r0 * m.template.data.shape[1], n), a)
            for (m, r0, _, n), (_, offset), a in zip(spans, self._splits, at, strict=True)
            if n
        ]
        self.direct.read_into([r for r, _ in reads], buf, [a for _, a in reads])
        loan = RowLoan(len(buf), self.held_neurons, [len(m.more) for m, _ in self._splits])
        for (m, r0, r1, _), a, n in zip(spans, at, sizes, strict=True):
            if n:
                m.attach(r1, buf[a : a + n].reshape(r1 - r0, -1))
        self._restream()
        self.held_neurons = want
        return loan

    def _restream(self) -> None:
        """Rebuild the stream's cycle over every split matrix's rows not held (after rows
        were held, given back or taken off the stream)."""
        self.row_stream.close(free_ring=False)  # the same buffers: see RowStream.close
        self.row_stream.clear()
        for m, offset in self._splits:
            self._add_pieces(m, offset)

    def _add_pieces(self, m, offset: int) -> None:
        """m's rows past those held, as pieces of the (cleared) row stream."""
        from edgerun.offload.rowstream import stream_ranges

        rb = m.template.data.shape[1]
        if m.name in self._unstreamed:  # read on demand (offload/head.CandidateHead)
            m.pieces = []
            return
        m.pieces = [
            (self.row_stream.add(offset + r0 * rb, (r1 - r0) * rb), r0, r1)
            for r0, r1 in stream_ranges(m.template, m.held_rows)
        ]

    def _fixed(self, m) -> bool:
        """Whether m is a head that holds the plan's fixed count of rows (a sketched
        head's, Plan.head_held_rows), not the FFN's share."""
        return self.plan.fixed_head and m.name == self.spec.global_tensors["output"]

    def _share_rows(self, neurons: int, rows: int) -> int:
        """A matrix's rows that `neurons` of a layer's d_ff hold: the same share of every
        streamed matrix (gate and up: `neurons`; down: of d_model; the head: of vocab)."""
        d_ff = self.spec.d_ff
        return rows if neurons >= d_ff else neurons * rows // d_ff

    def close(self) -> None:
        """Stop the row stream's reader threads and free its ring (it restarts on use)."""
        self.row_stream.close()

    def matrix(self, name: str):
        """A 2-D weight; the output head, when the plan streams it, as its mapped view
        (never read: head_executor computes with it)."""
        if self.plan.head_streamed and name == self.spec.global_tensors["output"]:
            return self._reader.view(name)
        return super().matrix(name)

    def head_executor(self, name: str):
        """The streamed output head (offload/rowstream.StreamedProjection), its first rows
        held in the share the FFN's are (or the plan's fixed count, when its other rows
        are to be sketched); None when the plan keeps it resident. The model
        asks for it after the layers: the stream reads in the order they compute."""
        from edgerun.offload.rowstream import StreamedProjection

        if not self.plan.head_streamed or name != self.spec.global_tensors["output"]:
            return None
        rows = self._reader.view(name).shape[0]
        if self.plan.fixed_head:  # a fixed count (its other rows to be sketched)
            held = min(rows, self.plan.head_held_rows)
        else:
            held = self._share_rows(self.held_neurons, rows)
        return StreamedProjection(self._split(name, held), self.row_stream, self.stats)

    def head_split(self):
        """(SplitMatrix, file offset) of the streamed head; None when it is not streamed."""
        name = self.spec.global_tensors["output"]
        return next(((m, off) for m, off in self._splits if m.name == name), None)

    def sketch_head(self, sketch, candidates: int):
        """Stop streaming the head's other rows: a CandidateHead (offload/head.py) reads
        the few a token's sketch scores choose. The stream is rebuilt without them."""
        from edgerun.offload.head import CandidateHead

        found = self.head_split()
        if found is None:
            raise InvalidArgumentError("sketch_head: this plan does not stream the head")
        m, offset = found
        if self._loans:
            raise InvalidArgumentError("sketch_head() with row loans outstanding")
        self._unstreamed.add(m.name)
        self._restream()
        return CandidateHead(m, sketch, self.direct, offset, candidates, self.stats)

    def _split(self, name: str, held: int):
        from edgerun.offload.rowstream import SplitMatrix, read_rows, split_rows

        t = self._reader.view(name)  # the stream and read_rows read it, never the mmap
        offset = self._reader.infos[name].offset
        held = split_rows(t, held)[0]
        m = SplitMatrix(name, t, read_rows(self.direct, offset, t, held) if held else None)
        self._add_pieces(m, offset)
        self._splits.append((m, offset))
        return m

    def ffn(self, spec: ModelSpec, layer: int) -> FFNExecutor:
        from edgerun.model.ffn import DenseFFN, check_shapes
        from edgerun.offload.rowstream import StreamedFFN

        self.check_vectors(spec, layer)
        names = [spec.layer_tensor(r, layer) for r in ("ffn_gate", "ffn_up", "ffn_down")]
        views = [self._reader.view(n) for n in names]
        d_ff = spec.d_ff_of(layer)  # a layer's own width (Gemma 4's double-wide FFNs)
        if layer in self.skip:  # replaced by a device executor: mapped views, never read
            return DenseFFN(
                *views, spec.activation, expected=(d_ff, spec.d_model), source=self._source,
                sparsity=spec.ffn_sparsity_of(layer),
            )  # fmt: skip
        ff, dm = (d_ff, spec.d_model), (spec.d_model, d_ff)
        check_shapes(zip(views, (ff, ff, dm)), self._source)  # before any row is read
        h = min(d_ff, self.held_neurons)
        h_down = self._share_rows(h, spec.d_model)
        gate, up, down = (self._split(n, k) for n, k in zip(names, (h, h, h_down)))
        return StreamedFFN(gate, up, down, spec.activation, self.row_stream, self.stats,
                           spec.ffn_sparsity_of(layer))  # fmt: skip

    @property
    def flash_reader(self):
        """The DirectReader all flash reads go through."""
        return self.direct

    def offload_stats(self) -> dict:
        r = self.direct
        return {
            "bytes_read": int(r.bytes_read),
            "read_s": r.read_seconds,  # the readers inside their reads, summed: rate and duty
            "io_s": self.stats.io_s,
            "mm_s": 0.0,
            "compute_s": self.stats.compute_s,
            "hit_rate": float("nan"),
            "active_fraction": 1.0,
            "held_neurons": self.held_neurons,  # a layer's rows held now (loans included)
            "lent_bytes": sum(loan.nbytes for loan in self._loans),
            "plan": self.plan.describe(),
            "pinned": 0,
            "prefetch_hits": 0,
            "prefetch_wasted": 0,
        }

    def reset_offload_stats(self) -> None:
        self.direct.reset_stats()
        self.stats.reset()
