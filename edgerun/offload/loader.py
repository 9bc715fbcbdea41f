"""Where a loaded model's weights live: a RAM budget (given, or planned for the memory
left) and this machine's measured figures -> a Plan -> the weight store and the
Transformer over it (resident, streamed dense, sparse from a bundle, layers on a GPU).

The Loader takes the narrow things it works on (the path, the opened file, the spec, the
tokenizer a sparse calibration encodes with, the context length, KV type and threads),
never the façade; api.Model holds one and reads its plan, store and Transformer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from edgerun import registry
from edgerun.errors import InvalidArgumentError, UnsupportedError
from edgerun.generate.engine import PREFILL_CHUNK
from edgerun.model.kvcache import KVCache, check_kv_type
from edgerun.model.transformer import Transformer
from edgerun.model.weights import ResidentStore
from edgerun.offload import budget as budget_mod
from edgerun.offload.budget import BudgetKeeper, drop_load_page_cache
from edgerun.runtime.sysinfo import current_rss_bytes, return_free_heap_to_os

if TYPE_CHECKING:
    import threading

    from edgerun.offload.plan import Plan
    from edgerun.offload.store import OffloadOptions

__all__ = [
    "DEFAULT_OFFLOAD",
    "KERNEL_FLOOR_BYTES",
    "KERNEL_PAGED_OUT_BYTES",
    "LOAN_CHAT_TOKENS",
    "Loader",
    "LoaderHooks",
    "kv_type_for",
    "runtime_floor_bytes",
]

# What loading the kernels adds to the process after load, as a cgroup counts it. Measured
# on Qwen2.5-Coder-1.5B at --ram-budget 800M: once 40 MiB of RSS (a VNNI host, first
# offloaded token minus load); with the warm-up loading every kernel (batched decode,
# tiled attention, prefill GEMMs) on a Zen 3 host (avx2 path), 701 -> 789 MiB of cgroup
# usage across the warm-up and its page-cache drop (anonymous +48, mapped LLVM code +33).
KERNEL_FLOOR_BYTES = 88 << 20
# What paging LLVM out after the warm-up gives back (offload/io.page_out_large_libraries):
# all of libllvmlite.so that was resident, part of it from the import (in the measured
# floor), part from loading the kernels (in KERNEL_FLOOR_BYTES). Qwen2.5-1.5B, Zen 3,
# avx2 kernels, 800M: 67 MiB, RSS 708 -> 642 MiB.
KERNEL_PAGED_OUT_BYTES = 60 << 20
# The chat length `edgerun plan` estimates the loan at (its KV pages are not lent)
LOAN_CHAT_TOKENS = 256
# With a RAM budget and no --offload: dense streaming. Measured on Qwen2.5-Coder-1.5B in
# an 800 MiB cgroup (benchmarks/offload.py): dense 0.83-0.87 tok/s, sparse + window
# 0.77-0.84 at the sparsity that keeps quality (0.10), and dense runs down to ~550 MiB
# where sparse needs the gate rows resident (~750 MiB).
DEFAULT_OFFLOAD = "dense"


def runtime_floor_bytes() -> int:
    """This process's runtime floor as a load measures it: RSS now, after the C heap's
    free pages went back to the OS (the tokenizer build leaves ~15 MiB there), plus
    KERNEL_FLOOR_BYTES. Budgets computed beside a load (tests, bench suite) use it too."""
    return_free_heap_to_os()
    return current_rss_bytes() + KERNEL_FLOOR_BYTES


def kv_type_for(kv_type: str | None, ram_budget) -> str:
    """The KV cache type asked for, else f32, or f16 under a RAM budget (llama.cpp's
    default): on Qwen2.5-Coder-1.5B at 2048 tokens that is 56 MiB more for held weights."""
    return check_kv_type(kv_type or ("f32" if ram_budget is None else "f16"))


def reader_cores(plan, threads: int) -> int:
    """Cores a decode step leaves to the weight readers (runtime/cpu_share.ThreadGovernor):
    one where offloading reads FFN weights from flash every token (dense streaming's
    reader threads, sparse mode's I/O threads) and there is a core to spare. Sparse
    mode, Qwen2.5-Coder-1.5B at 800 MiB on 2 vCPUs: 1 compute thread 0.59 / 0.62
    tok/s (I/O wait 1.24-1.28 s a token), 2 threads 0.50 / 0.47 (1.69-1.84 s)."""
    streams = (
        plan is not None and plan.mode in ("dense", "sparse") and plan.read_bytes_per_token > 0
    )
    return 1 if streams and threads > 1 else 0


def _none(*_a, **_k):
    return None


@dataclass
class LoaderHooks:
    """What placement needs from the floors beside and above offload/, passed in by the
    layer that loads (api): this machine's measured figures (device/calibration.py) and
    the torch device's part (gpu/). Each is looked up when called."""

    # (threads, gpu_device) -> cached DeviceFigures, or None where none are measured
    cached_figures: Callable = _none
    # (threads, gpu_device) -> DeviceFigures, measured once and cached
    calibrate: Callable | None = None
    # (bundle file, threads) -> OffloadFigures: the executors timed on this machine
    offload_figures: Callable | None = None
    # gpu_device -> the torch device (fails where torch or the device is missing)
    resolve_gpu: Callable | None = None
    # gpu_device -> bytes of one element of the weights it holds
    gpu_dtype_bytes: Callable | None = None
    # (transformer, weights, layers, gpu_device, parts) -> a placement with describe()
    move_layers: Callable | None = None


class Loader:
    """One model's placement: its plan, weight store and Transformer, and the planning
    that sized them. `place` (under a budget, an offload mode or a GPU budget) or
    `build_resident` makes the store; until then `transformer` is None."""

    def __init__(
        self,
        path: Path,
        file,
        spec,
        tokenizer,
        n_ctx: int,
        kv_type: str,
        threads: int,
        auto_threads: bool = False,
        floor_bytes: int | None = None,
        device_profile=None,
        prefill_chunk: int = PREFILL_CHUNK,
        hooks: LoaderHooks | None = None,
    ) -> None:
        """file: the opened GGUF reader or edgerun pack; tokenizer: what a sparse load's
        calibration encodes its text with; floor_bytes: the runtime floor measured at load
        (runtime_floor_bytes); device_profile: an emulated device (its storage throttle)."""
        self.path = Path(path)
        self.file = file
        self.spec = spec
        self.tokenizer = tokenizer
        self.n_ctx = n_ctx
        self.kv_type = kv_type
        self.threads = threads
        self.auto_threads = auto_threads
        self.floor_bytes = runtime_floor_bytes() if floor_bytes is None else floor_bytes
        self.device_profile = device_profile
        self.prefill_chunk = prefill_chunk
        self.hooks = hooks if hooks is not None else LoaderHooks()
        self.plan: Plan | None = None
        self.store = None
        self.transformer: Transformer | None = None
        self.gpu_placement = None
        self.budget_keeper: BudgetKeeper | None = None
        # (ram_budget, offload, offload_options, gpu_budget, gpu_device) of the load
        self.placement_args: tuple = (None, None, None, None, "cuda")
        # what a load given no budget did: a budget planned for the memory left
        # (auto_budget), or why the interleaved decode copies are off; their bytes
        self.auto_budget_note = ""
        self.interleave_note = ""
        self.interleaved_bytes = 0

    # -- sizes -----------------------------------------------------------------
    @property
    def model_bytes(self) -> int:
        """Bytes of the weights on disk: the GGUF file (all shards of a split one), or all
        files of a pack."""
        if self.path.is_dir():
            return sum(f.stat().st_size for f in self.path.rglob("*") if f.is_file())
        return self.file.file_size

    def footprint(self):
        from edgerun.offload.plan import footprint

        return footprint(self.spec, self.file, self.kv_type)

    def minimum_ram_budget(self, mode: str | None = None) -> int:
        """The smallest --ram-budget this model loads with (floor measured in this process)."""
        from edgerun.offload.plan import minimum_budget, minimum_experts_budget
        from edgerun.offload.store import OffloadOptions

        if getattr(self.spec, "n_expert", 0):
            return minimum_experts_budget(self.footprint(), self.floor_bytes, self.n_ctx)
        return minimum_budget(
            self.footprint(),
            self.floor_bytes,
            self.n_ctx,
            mode or DEFAULT_OFFLOAD,
            allow_predictor=False,
            prefetch=OffloadOptions().prefetch,
        )

    def auto_budget(
        self, kv_type: str | None, headroom: int, anonymous_rss: int
    ) -> tuple[int | None, str]:
        """A RAM budget for a load given none, where the model does not fit the memory
        left, `headroom` (sysinfo.memory_headroom_bytes: the machine's, or its cgroup's): its
        mapped weights would be paged in and out at every token (Qwen2.5-1.5B in an 881
        MB cgroup: 1.10-1.37 tok/s), where dense offloading plans for the limit (9.1).
        anonymous_rss: what the process holds that nothing reclaims
        (sysinfo.anonymous_rss_bytes). Returns (None, "") where it fits; (None, why)
        where what is left is below the model's minimum budget (the mapping it is,
        then); else (budget, what it did). Sets self.kv_type as that budget has it (f16
        unless asked otherwise)."""
        kv = KVCache.bytes_for(self.spec, self.n_ctx, self.kv_type)
        need = self.file.file_size + kv + (64 << 20)
        if need <= headroom:
            return None, ""
        if self.split_shards():
            return None, (
                f"the model needs ~{need >> 20} MiB and {headroom >> 20} MiB is left, but a "
                "split GGUF is not streamed: decoding from the mapped shards (slow)"
            )
        # what the process holds that nothing reclaims, plus what is left (which counts
        # mapped files, the libraries' code included, as reclaimable: RSS would count them
        # twice), less the 5% a cgroup's page cache and glibc's slack take beyond a budget:
        # in a memory cgroup, limit / 1.05 (the benchmarks' cgroups are budget + 5%)
        budget = int((anonymous_rss + headroom) / 1.05)
        self.kv_type = kv_type_for(kv_type, budget)
        minimum = self.minimum_ram_budget()
        short = f"the model needs ~{need >> 20} MiB and {headroom >> 20} MiB is left"
        if budget < minimum:
            self.kv_type = kv_type_for(kv_type, None)
            return None, (
                f"{short}, less than its minimum RAM budget ({minimum >> 20} MiB): "
                "decoding from the mapped file (slow)"
            )
        return budget, (
            f"{short}: planned for a RAM budget of {budget >> 20} MiB ({DEFAULT_OFFLOAD} "
            "offloading; --ram-budget / ram_budget= sets another)"
        )

    def split_shards(self) -> int:
        """How many GGUF shards the model is split into (0: one file, or a pack)."""
        return len(getattr(self.file, "shards", ()))

    def refuse_split_streaming(self, what: str) -> None:
        """A split GGUF is read through its mapped shards only: offloading streams weights
        from one file by offset (the flash reader, the offload bundle), which a split model
        does not have. Clear error, before any planning or compiling."""
        n = self.split_shards()
        if n:
            raise UnsupportedError(
                f"{self.path}: {what} needs the model in one GGUF file, and this one is split "
                f"into {n} shards. Load it without a RAM budget or offload mode (the shards "
                "are mapped), or merge them first: llama-gguf-split --merge "
                f"{self.path.name} merged.gguf"
            )

    # -- planning --------------------------------------------------------------
    def plan_for(
        self,
        ram_budget,
        mode: str | None = None,
        options: dict | None = None,
        gpu_budget: int | str | None = None,
        gpu_device: str | None = None,
        device=None,
        lent_bytes: int = 0,
    ) -> tuple[Plan, OffloadOptions]:
        """Where this model's parts would live under `ram_budget` (and `gpu_budget` on
        torch device `gpu_device`), and the offload options. lent_bytes: streamed rows
        held on loan (dense offloading, offload/kv_loan.py) that the prediction counts.

        With only a budget (mode None) a model that fits stays resident; otherwise the
        FFNs are offloaded in `mode` (default DEFAULT_OFFLOAD). In sparse mode a saved
        neuron profile (`edgerun profile`) pins each layer's hottest neurons. `device`
        (DeviceFigures) defaults to this machine's cached calibration."""
        from edgerun.offload.plan import parse_budget, plan, resident_need, resident_plan
        from edgerun.offload.store import OffloadOptions

        fp = self.footprint()
        budget = parse_budget(ram_budget) if ram_budget is not None else 1 << 62
        gpu = parse_budget(gpu_budget, what="GPU budget") if gpu_budget is not None else 0
        opts = OffloadOptions.from_dict(options)
        dev = device if device is not None else self.device_figures(gpu_device if gpu else None)
        dtype_bytes = self.hooks.gpu_dtype_bytes(gpu_device or "cuda") if gpu else 2
        # torch on the CPU is slower than our kernels; it is asked for to test the path
        force = bool(gpu) and str(gpu_device).startswith("cpu")
        if mode is None and (ram_budget is not None or gpu):
            fits = resident_plan(
                fp,
                self.model_bytes,
                budget,
                self.floor_bytes,
                self.n_ctx,
                device=dev,
                gpu_budget=gpu,
                gpu_dtype_bytes=dtype_bytes,
                gpu_force=force,
            )
            if fits is not None:
                return fits, opts
        if self.path.is_dir():  # a pack that fits stays resident (above); flash needs GGUF
            need = resident_need(fp, self.model_bytes, self.floor_bytes, self.n_ctx)
            raise InvalidArgumentError(
                f"{self.path}: offloading needs a GGUF file, not an edgerun pack; this pack "
                f"needs a RAM budget of {math.ceil(need / 2**20)} MiB to stay "
                "resident"
            )
        if getattr(self.spec, "n_expert", 0):
            return self._experts_plan(fp, budget, mode, dev, gpu, dtype_bytes, force), opts
        mode = mode or DEFAULT_OFFLOAD
        if mode not in ("sparse", "dense"):
            raise InvalidArgumentError(f"offload must be 'sparse' or 'dense', got {mode!r}")
        if mode == "dense":
            opts.sparsity = 0.0
            if device is None and not gpu and self.auto_threads and self.threads > 1:
                # decode steps will leave the row stream's reader a core (reader_cores):
                # predict with the kernels' rate on the threads they will have, if measured
                dev = self.hooks.cached_figures(self.threads - 1, None) or dev
        profile = self.neuron_profile(opts.profile) if mode == "sparse" and opts.hot > 0 else None
        bundle = self.bundle_file() if mode == "sparse" else None  # dense streams the GGUF
        offload = None
        if bundle is not None and device is not None:  # a calibrated prediction: time the
            offload = self.hooks.offload_figures(bundle, self.threads)  # executors on it too

        def plan_with(floor: int, lent: int = lent_bytes) -> Plan:
            return plan(
                fp,
                budget,
                floor,
                self.n_ctx,
                mode=mode,
                active_fraction=max(0.05, 1.0 - opts.sparsity),
                allow_predictor=False,
                prefetch=opts.prefetch,
                frequencies=None if profile is None else profile.counts,
                hot_share=opts.hot if opts.window > 0 else 0.0,
                device=dev,
                gpu_budget=gpu,
                gpu_dtype_bytes=dtype_bytes,
                gpu_force=force,
                gap_bytes=opts.gap_bytes,
                offload=offload,
                head_candidates=opts.head_candidates if mode == "dense" else 0,
                head_rank=opts.head_rank,
                head_held=opts.head_held,
                lent_bytes=lent,
            )

        def steady(lent: int = lent_bytes) -> Plan:
            p = plan_with(self.floor_bytes, lent)
            if mode == "dense" and opts.hold_after_warm_up and p.cache_neurons < fp.d_ff:
                p = self._with_rows_after_kernels(p, lambda floor: plan_with(floor, lent))
            return p

        p = steady()
        if mode == "dense" and opts.kv_loan_tiers and p.cache_neurons < fp.d_ff and not lent_bytes:
            # what a short chat leaves unused of what the plan reserves: the KV cache's
            # unwritten part, the plan's margins and slack, less what the loan keeps free
            from edgerun.offload.plan import MARGIN_BYTES

            chat = min(self.n_ctx, LOAN_CHAT_TOKENS)
            est = (
                p.kv_bytes
                - fp.kv_bytes(chat)
                + max(0, p.budget - p.used_bytes)
                + MARGIN_BYTES
                - budget_mod.KV_LOAN_MARGIN
            )
            if est > 0:
                q = steady(est)
                p.notes.append(
                    "after the warm-up the memory measured free under the budget holds "
                    "more of the streamed rows (the KV cache's unwritten part of its "
                    f"{p.kv_bytes / 2**20:,.0f} MiB, the margins), given back before a prompt "
                    f"or the cache needs it: in a chat of {chat} tokens at least "
                    f"{q.lent_bytes / 2**20:,.0f} MiB, {q.read_bytes_per_token / 2**20:,.1f} MiB "
                    f"read a token, {q.predicted_tok_s:,.1f} tok/s (offload/kv_loan.py)"
                )
        if force:
            p.notes.append(
                "--gpu-device cpu runs the torch path on the CPU (a test, not a speedup)"
            )
        return p, opts

    def _experts_plan(
        self, fp, budget: int, mode: str | None, dev, gpu: int = 0, dtype_bytes: int = 2,
        force: bool = False,
    ) -> Plan:  # fmt: skip
        """A mixture-of-experts model that does not fit: its routed experts on flash
        (offload/experts.py), whatever the offload mode asked (dense rows or sparse
        neurons are FFN placements; a MoE's FFN is its experts); a GPU budget takes
        attention layers."""
        from edgerun.offload.plan import experts_plan

        if mode not in (None, "dense", "experts"):
            raise UnsupportedError(
                f"{self.path}: a mixture-of-experts model streams its routed experts under a "
                f"RAM budget; offload mode {mode!r} is for dense FFNs (leave --offload out)"
            )
        return experts_plan(
            fp, budget, self.floor_bytes, self.n_ctx, device=dev, gpu_budget=gpu,
            gpu_dtype_bytes=dtype_bytes, gpu_force=force,
        )  # fmt: skip

    def _with_rows_after_kernels(self, load_plan: Plan, plan_with) -> Plan:
        """The plan of the steady state when LLVM's pages can be given back once the
        kernels are loaded (offload/io.page_out_large_libraries): the runtime floor less
        KERNEL_PAGED_OUT_BYTES, and the FFN rows that memory holds read after the warm-up
        (Plan.deferred_bytes), so the load's peak stays where `load_plan` put it."""
        from edgerun.offload.io import can_page_out

        if not can_page_out():
            return load_plan
        steady = plan_with(self.floor_bytes - KERNEL_PAGED_OUT_BYTES)
        extra = steady.cache_neurons - load_plan.cache_neurons
        if extra <= 0:
            return load_plan
        steady.deferred_neurons = extra
        steady.deferred_bytes = steady.cache_bytes - load_plan.cache_bytes
        steady.notes.append(
            f"{steady.deferred_bytes / 2**20:,.0f} MiB of the rows held (FFN, and a streamed "
            "head) are read once the kernels are loaded and LLVM's pages given back (the "
            "floor counts the kernels "
            f"at {(KERNEL_FLOOR_BYTES - KERNEL_PAGED_OUT_BYTES) >> 20} MiB after that)"
        )
        return steady

    def predicted_plan(self, threads: int | None = None, decode_reserve: int = 0) -> Plan:
        """The plan of this placement (the budgets and devices it was loaded with),
        predicted with this machine's calibrated figures at `threads` (measured once and
        cached), and the rows its KV loan holds now: what `edgerun bench` compares its
        measurement to. By default the threads its decode steps run on (fewer by
        `decode_reserve`, where they leave the row stream's reader a core)."""
        ram, mode, opts, gpu, gpu_device = self.placement_args
        gpu_dev = gpu_device if gpu is not None else None
        threads = threads or max(1, self.threads - decode_reserve)
        figs = self.hooks.calibrate(threads, gpu_dev)
        if ram is None and mode is None and gpu is None:
            ram = 1 << 62  # resident: a budget it fits
        loan = self.kv_loan
        lent = loan.lent_bytes if loan is not None else 0
        return self.plan_for(ram, mode, opts, gpu, gpu_dev, device=figs, lent_bytes=lent)[0]

    def device_figures(self, gpu_device: str | None = None, measure: bool = False):
        """This machine's measured rates (device/calibration.py): cached ones, measured
        when `measure` or a GPU is asked for and none are cached, else the defaults."""
        figs = self.hooks.cached_figures(self.threads, gpu_device)
        if figs is None and (measure or gpu_device is not None) and self.hooks.calibrate:
            figs = self.hooks.calibrate(self.threads, gpu_device)
        if figs is None:
            from edgerun.offload.plan import DeviceFigures

            figs = DeviceFigures()
        return figs

    def bundle_file(self) -> Path | None:
        """This model's flash bundle when it exists (made by the first offloaded run)."""
        from edgerun.offload.bundle import bundle_path, source_sha256

        st = getattr(self.store, "bundle", None)
        if st is not None:
            return Path(st.path)
        m = registry.find_by_file(self.path)
        p = bundle_path(self.path, getattr(m, "sha256", None) or source_sha256(self.path))
        return p if p.exists() else None

    def neuron_profile(self, path=None):
        """The neuron profile at `path`, else this model's saved one (`edgerun profile`),
        or None when there is none."""
        from edgerun.offload.profile import load_profile

        return load_profile(self.path, self.spec, path)

    def reader_cores(self) -> int:
        """reader_cores of this placement's plan and threads."""
        return reader_cores(self.plan, self.threads)

    @property
    def kv_loan(self):
        """offload/kv_loan.KVLoan: rows held on the unwritten KV reserve (None: none)."""
        keeper = self.budget_keeper
        return keeper.kv_loan if keeper is not None else None

    # -- building ----------------------------------------------------------------
    def build_resident(self) -> Transformer:
        """The Transformer over the file's mapped tensors."""
        self.store = ResidentStore(self.file, str(self.path))
        self.transformer = Transformer(self.spec, self.store, str(self.path))
        return self.transformer

    def place(
        self,
        ram_budget,
        mode: str | None,
        options: dict | None,
        gpu_budget=None,
        gpu_device: str = "cuda",
    ) -> Transformer:
        """Plan and build an offloaded (or GPU-placed) load: the kernels compiled first
        where a budget is given (compiling beside the budgeted weights thrashes), then
        the store the plan sizes."""
        self.placement_args = (ram_budget, mode, options, gpu_budget, gpu_device)
        if ram_budget is not None or mode not in (None, "resident"):
            self.refuse_split_streaming("a RAM budget (offloading)")
        if ram_budget is not None:
            from edgerun.offload.plan import parse_budget
            from edgerun.offload.warm_kernels import ensure_kernels_compiled
            from edgerun.ops import qmatvec

            # the children compile within what the budget leaves beside this process
            room = max(0, parse_budget(ram_budget) - current_rss_bytes())
            ensure_kernels_compiled(self.path, self.kv_type, qmatvec.kernel_path(), room)
        self._offload(ram_budget, mode, options, gpu_budget, gpu_device)
        return self.transformer

    def _offload(
        self,
        ram_budget,
        mode: str | None,
        options: dict | None,
        gpu_budget=None,
        gpu_device: str = "cuda",
    ) -> None:
        """Swap the resident FFNs for flash executors sized by a plan of the budget, and
        move the layers the plan gives the GPU onto the torch device."""
        from edgerun.offload.store import OffloadStore, prepare

        if gpu_budget is not None:  # a missing torch or device fails before any work
            self.hooks.resolve_gpu(gpu_device)
        self.plan, opts = self.plan_for(ram_budget, mode, options, gpu_budget, gpu_device)
        if self.plan.mode != "resident":
            self.refuse_split_streaming(f"{self.plan.mode} offloading")
        # The page cache imports and planning left counts against the budget while the
        # weights arrive (Qwen2.5-1.5B at 800M: ~90 MiB over at the load's peak); drop it
        # now, and again once the kernels are loaded (after_warm_up), and keep LLVM's
        # faults from reading ahead while they load.
        drop_load_page_cache(self.plan)
        if self.plan.mode != "resident":
            from edgerun.offload.io import (
                random_access_large_libraries,
                return_large_frees_to_os,
            )

            random_access_large_libraries()
            return_large_frees_to_os()
        if self.plan.mode in ("sparse", "resident"):  # sparse calibration runs it first
            self.build_resident()
        if self.plan.mode == "experts":
            from edgerun.offload.experts import ExpertStreamStore

            self.store = ExpertStreamStore(self.file, str(self.path), self.spec, self.plan, opts)
            if self.device_profile is not None:
                self.store.flash_reader.throttle = self.device_profile.throttle()
            self.transformer = Transformer(self.spec, self.store, str(self.path))
        elif self.plan.mode == "dense":
            from edgerun.offload.store import DenseStreamStore

            self.store = DenseStreamStore(
                self.file,
                str(self.path),
                self.spec,
                self.plan,
                opts,
                skip=frozenset(self.plan.gpu_ffn_layers),
            )
            if self.device_profile is not None:
                self.store.flash_reader.throttle = self.device_profile.throttle()
            self.transformer = Transformer(self.spec, self.store, str(self.path))
        elif self.plan.mode != "resident":
            if any(m is not None for m in self.spec.layer_ffn_sparsity):
                raise UnsupportedError(
                    f"{self.path}: offload mode 'sparse' predicts which FFN neurons a token "
                    "needs, and this model's FFNs cut their gates by their own statistics "
                    "(Gemma 3n's activation sparsity), which that prediction does not "
                    "compute; leave --offload out (dense streaming under the budget)"
                )
            m = registry.find_by_file(self.path)
            bundle, cal = prepare(
                self.path,
                self.file,
                self.transformer,
                self.tokenizer,
                sha256=getattr(m, "sha256", None),
                kv_type=self.kv_type,
                step=self.prefill_chunk,
            )
            hot = None
            if self.plan.pinned_neurons:
                prof = self.neuron_profile(opts.profile)
                hot = [prof.hot_order(i) for i in range(self.spec.n_layers)]
            self.store = OffloadStore(
                self.file, str(self.path), self.spec, bundle, cal, self.plan, opts, hot
            )
            if self.device_profile is not None:
                self.store.flash_reader.throttle = self.device_profile.throttle()
            self.transformer = Transformer(self.spec, self.store, str(self.path))
        p = self.plan
        if p.gpu_ffn_layers or p.gpu_attention_layers:
            weights = ResidentStore(self.file, str(self.path))
            self.gpu_placement = [
                self.hooks.move_layers(self.transformer, weights, list(layers), gpu_device, (part,))
                for layers, part in (
                    (p.gpu_ffn_layers, "ffn"),
                    (p.gpu_attention_layers, "attention"),
                )
                if layers
            ]
            if p.mode != "resident":
                from edgerun.offload.store import release_file_pages

                release_file_pages(self.file)  # the moved weights were read once, here
        drop_load_page_cache(self.plan)

    def keeper(self, lock: threading.RLock) -> BudgetKeeper:
        """The after-warm-up work of this budgeted load (offload/budget.BudgetKeeper),
        made once; its hook is `after_warm_up`."""
        if self.budget_keeper is None:
            sha = None
            if self.plan.head_candidates:  # a head sketch is keyed by the model file
                sha = getattr(registry.find_by_file(self.path), "sha256", None)
            self.budget_keeper = BudgetKeeper(
                self.plan,
                self.store,
                self.transformer,
                self.tokenizer,
                self.kv_type,
                self.prefill_chunk,
                lock,
                registry.cache_dir(),
                self.path,
                sha,
            )
        return self.budget_keeper

    def offload_stats(self) -> dict | None:
        """Flash reads and the I/O / cache / compute split since the last reset (None when
        the model is resident)."""
        st = getattr(self.store, "offload_stats", None)
        return st() if st else None

    def reset_offload_stats(self) -> None:
        if hasattr(self.store, "reset_offload_stats"):
            self.store.reset_offload_stats()

    def close(self) -> None:
        """Stop the weight store's reader threads, if it streams (they start again on use)."""
        close_store = getattr(self.store, "close", None)
        if close_store is not None:
            close_store()
