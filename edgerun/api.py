"""The embeddable API: load a model by registry name or path, then tokenize,
score, generate and chat."""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edgerun import registry
from edgerun.arch import spec_from_gguf
from edgerun.errors import InvalidArgumentError, ModelNotFoundError
from edgerun.formats.gguf import read_gguf
from edgerun.generate.chat_template import render_chat
from edgerun.generate.engine import (
    PREFILL_CHUNK,
    Engine,
    EngineHooks,
    Generator,
    check_token_ids,
    prefill_chunk_within,
)
from edgerun.generate.prefix_cache import PrefixCache
from edgerun.generate.sequence import GenerationStats, WarmUp
from edgerun.generate.settings import ModelSettings
from edgerun.model.kvcache import KVCache, check_kv_type
from edgerun.model.transformer import Transformer
from edgerun.model.weights import ResidentStore
from edgerun.offload.budget import BudgetKeeper, drop_load_page_cache, trim_heap_after_prompt_chunk
from edgerun.runtime.cpu_share import ThreadGovernor, set_threads, wait_policy_spins
from edgerun.runtime.sysinfo import (
    anonymous_rss_bytes,
    current_rss_bytes,
    default_threads,
    memory_headroom_bytes,
    return_free_heap_to_os,
)
from edgerun.serving.batching import BatchScheduler, Serving
from edgerun.tokenizer import Tokenizer, tokenizer_from_gguf_metadata


def resolve_model(model: str | os.PathLike | None, auto_pull: bool | None = None) -> Path:
    """A registry name, an alias or a path (GGUF file or edgerun pack directory) -> the path.

    auto_pull None means: install the default model on first use, never others.
    """
    if model is None:
        m = registry.default_manifest()
    else:
        p = Path(model).expanduser()
        if p.exists() or str(model).endswith(".gguf") or os.sep in str(model):
            if not p.exists():
                raise ModelNotFoundError(f"model file not found: {p}")
            return p
        m = registry.find(str(model))
        if m is None:
            import difflib

            names = [x.name for x in registry.manifests()]
            close = difflib.get_close_matches(str(model), names, n=1, cutoff=0.5)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ModelNotFoundError(
                f"unknown model '{model}': not a file and not a registry name; {hint}"
                f"(known: {', '.join(names)}); see `edgerun list`"
            )
    if not registry.is_installed(m):
        pull = m.default if auto_pull is None else auto_pull
        if not pull:
            raise ModelNotFoundError(
                f"model '{m.name}' is known but not installed; install it with\n"
                f"  edgerun pull {m.name}\nor\n  {sys.executable} -m {m.pip_command}"
            )
        registry.pull(m)
    return registry.resolve_path(m, progress=True)


def settings_for(path: str | os.PathLike) -> ModelSettings:
    """The recommended settings of the registry model whose file `path` is, else the defaults."""
    m = registry.find_by_file(path)
    return m.parameters if m is not None else ModelSettings()


if TYPE_CHECKING:
    from edgerun.offload.plan import Plan
    from edgerun.offload.store import OffloadOptions
    from edgerun.serving.session import Session

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
# Kept free under a budget when rows are lent on its unused memory (offload/kv_loan.py):
# what the RSS does not show or not yet: the page cache later reads leave and the heap's
# growth (placement.LATE_MEMORY_BYTES), embedding rows a long chat touches
# (placement.EMBEDDING_TOUCH_BYTES), and a decode step's temporaries
KV_LOAN_MARGIN = 32 << 20
# The chat length `edgerun plan` estimates the loan at (its KV pages are not lent)
LOAN_CHAT_TOKENS = 256


def runtime_floor_bytes() -> int:
    """This process's runtime floor as a load measures it: RSS now, after the C heap's
    free pages went back to the OS (the tokenizer build leaves ~15 MiB there), plus
    KERNEL_FLOOR_BYTES. Budgets computed beside a load (tests, bench suite) use it too."""
    return_free_heap_to_os()
    return current_rss_bytes() + KERNEL_FLOOR_BYTES


# With a RAM budget and no --offload: dense streaming. Measured on Qwen2.5-Coder-1.5B in
# an 800 MiB cgroup (benchmarks/offload.py): dense 0.83-0.87 tok/s, sparse + window
# 0.77-0.84 at the sparsity that keeps quality (0.10), and dense runs down to ~550 MiB
# where sparse needs the gate rows resident (~750 MiB).
DEFAULT_OFFLOAD = "dense"


class Model:
    """A loaded model with its tokenizer and one conversation's KV cache.

    Sampling arguments, n_ctx and the system prompt left as None take the model's
    recommended settings (`self.settings`: its registry manifest's [parameters]).
    """

    def __init__(
        self,
        path: Path,
        n_ctx: int | None = None,
        threads: int | None = None,
        kv_type: str | None = None,
        settings: ModelSettings | None = None,
        ram_budget: int | str | None = None,
        offload: str | None = None,
        offload_options: dict | None = None,
        context_policy: str = "error",
        gpu_budget: int | str | None = None,
        gpu_device: str = "cuda",
        device_profile=None,
        interleave: bool | None = None,
    ) -> None:
        t0 = time.perf_counter()
        self.device_profile = None
        if device_profile is not None:  # emulate a smaller device: caps, slow storage
            from edgerun.device.profile import DeviceProfile, load_device_profile
            from edgerun.offload.plan import parse_budget

            prof = device_profile
            if not isinstance(prof, DeviceProfile):
                prof = load_device_profile(prof)
            self.device_profile = prof
            threads = min(threads or default_threads(), prof.threads)
            if prof.kernels is not None:
                # the device's CPU takes this kernel path (a Pi: the generic int8 kernels,
                # which an x86 host emulates with its own int8 path, the same block kernels
                # on other instructions); the path is the process's, so an emulated load
                # sets it for all
                from edgerun.ops import qmatvec

                paths = qmatvec.available_paths()
                if prof.kernels in paths:
                    qmatvec.set_kernel_path(prof.kernels)
                elif prof.kernels == "int8" and paths[-1] in qmatvec.INT8_PATHS:
                    qmatvec.set_kernel_path(paths[-1])
            cap = prof.ram_budget_bytes
            ram_budget = cap if ram_budget is None else min(parse_budget(ram_budget), cap)
        self.kv_type = kv_type_for(kv_type, ram_budget)
        self.path = Path(path)
        self.settings = settings if settings is not None else settings_for(self.path)
        if n_ctx is None:
            n_ctx = self.settings.n_ctx
        if self.path.is_dir():  # an edgerun pack (edgerun convert)
            from edgerun.formats.pack import read_pack

            self.file = read_pack(self.path)
            self.spec = self.file.spec
            self.tokenizer: Tokenizer = self.file.tokenizer()
        else:
            self.file = read_gguf(self.path)
            meta = self.file.metadata
            self.spec = spec_from_gguf(meta, str(self.path))
            self.tokenizer = tokenizer_from_gguf_metadata(meta)
        if n_ctx <= 0:
            n_ctx = self.spec.context_length
        self.n_ctx = min(n_ctx, self.spec.context_length)
        if self.tokenizer.chat_template:  # untrusted: compiled (and checked) once, here
            from edgerun.generate.chat_template import check_template

            check_template(self.tokenizer.chat_template)
        self.plan = None
        self.floor_bytes = runtime_floor_bytes()
        # A default load of a GGUF sizes itself to the memory left (measured once): where
        # the model does not fit, it plans for what is left as --ram-budget would
        # (_auto_budget); where it does, it makes the interleaved copies that fit
        # (copies_fit). The notes say what it did.
        self.auto_budget_note = self.interleave_note = ""
        headroom = None
        placed = ram_budget is not None or offload is not None or gpu_budget is not None
        if not placed and interleave is None and hasattr(self.file, "release_pages"):
            headroom = memory_headroom_bytes()
            ram_budget, self.auto_budget_note = self._auto_budget(kv_type, headroom)
        offloading = placed or ram_budget is not None  # given, or planned just now
        self.store = None  # built below: resident, or by _offload once the plan is known
        self.budget_keeper: BudgetKeeper | None = None  # a budgeted load's hooks
        if interleave and offloading:
            raise InvalidArgumentError(
                "interleave=True: the interleaved decode copies are for resident models, "
                "not with ram_budget, offload or gpu_budget"
            )
        if not offloading:
            self._build_resident()
        # bytes of the interleaved decode copies (qmatvec_rows16; resident loads on the
        # vnni path unless interleave=False), 0 without them. By default only where the
        # mapped rows' pages can be let go (a GGUF), so the copies cost no memory, and
        # where they fit in the memory left (copies_fit).
        self.interleaved_bytes = 0
        if not offloading and headroom is not None:
            need = self.transformer.interleave_bytes()
            interleave, self.interleave_note = copies_fit(need, headroom)
        if not offloading and interleave:
            self.interleaved_bytes = self.transformer.interleave_weights()
        self.threads = threads or default_threads()
        self.auto_threads = threads is None  # the governor's to choose (cpu_share.py)
        if self.threads < 1:
            raise InvalidArgumentError(f"threads must be >= 1, got {self.threads}")
        set_threads(self.threads)
        # Automatic threads follow the cores other processes leave free (runtime/cpu_share.py);
        # a count the caller chose is kept as is.
        self.governor = ThreadGovernor(
            self.threads, default_threads(), adaptive=threads is None and wait_policy_spins()
        )
        self.gpu_placement = None
        # Under a RAM budget a prompt chunk's temporaries must fit in the plan's step
        # margin. Set before offloading: its first run calibrates through logits()
        self.prefill_chunk = PREFILL_CHUNK
        if ram_budget is not None:
            from edgerun.offload.plan import STEP_MARGIN_BYTES

            self.prefill_chunk = prefill_chunk_within(self.spec, STEP_MARGIN_BYTES)
        self._placement_args = (ram_budget, offload, offload_options, gpu_budget, gpu_device)
        if offloading:
            if ram_budget is not None:  # compiling beside the budgeted weights thrashes
                from edgerun.offload.plan import parse_budget
                from edgerun.offload.warm_kernels import ensure_kernels_compiled
                from edgerun.ops import qmatvec

                # the children compile within what the budget leaves beside this process
                room = max(0, parse_budget(ram_budget) - current_rss_bytes())
                ensure_kernels_compiled(self.path, self.kv_type, qmatvec.kernel_path(), room)
            self._offload(ram_budget, offload, offload_options, gpu_budget, gpu_device)
            if self.auto_threads:
                self.governor.decode_reserve = self.reader_cores()
        lock = threading.RLock()
        if offloading:
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
        # What every driver (generate, sessions, the server) shares. Under a RAM budget the
        # plan reserves one n_ctx window of KV cache; concurrent requests share it
        # (sched/batching.BatchScheduler admits by it).
        self.engine = Engine(
            self.transformer,
            self.tokenizer,
            self.n_ctx,
            self.kv_type,
            self.governor,
            lock=lock,
            prefill_chunk=self.prefill_chunk,
            kv_budget_tokens=self.n_ctx if ram_budget is not None else None,
            hooks=EngineHooks(
                after_warm_up=self._after_warm_up if offloading else None,
                after_prompt_chunk=trim_heap_after_prompt_chunk if ram_budget is not None else None,
            ),
            settings=self.settings,
            path=self.path,
        )
        self.generator = Generator(self.engine, context_policy=context_policy)
        self.serving = Serving(self.engine)
        self.load_seconds = time.perf_counter() - t0

    @property
    def model_bytes(self) -> int:
        """Bytes of the weights on disk: the GGUF file, or all files of a pack."""
        if self.path.is_dir():
            return sum(f.stat().st_size for f in self.path.rglob("*") if f.is_file())
        return self.path.stat().st_size

    def _auto_budget(self, kv_type: str | None, headroom: int) -> tuple[int | None, str]:
        """A RAM budget for a load given none, where the model does not fit the memory
        left, `headroom` (sysinfo.memory_headroom_bytes: the machine's, or its cgroup's): its
        mapped weights would be paged in and out at every token (Qwen2.5-1.5B in an 881
        MB cgroup: 1.10-1.37 tok/s), where dense offloading plans for the limit (9.1).
        Returns (None, "") where it fits; (None, why) where what is left is below the
        model's minimum budget (the mapping it is, then); else (budget, what it did).
        Sets self.kv_type as that budget has it (f16 unless asked otherwise)."""
        kv = KVCache.bytes_for(self.spec, self.n_ctx, self.kv_type)
        need = self.file.file_size + kv + (64 << 20)
        if need <= headroom:
            return None, ""
        # what the process holds that nothing reclaims, plus what is left (which counts
        # mapped files, the libraries' code included, as reclaimable: RSS would count them
        # twice), less the 5% a cgroup's page cache and glibc's slack take beyond a budget:
        # in a memory cgroup, limit / 1.05 (the benchmarks' cgroups are budget + 5%)
        budget = int((anonymous_rss_bytes() + headroom) / 1.05)
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

        fp = self._footprint()
        budget = parse_budget(ram_budget) if ram_budget is not None else 1 << 62
        gpu = parse_budget(gpu_budget, what="GPU budget") if gpu_budget is not None else 0
        opts = OffloadOptions.from_dict(options)
        dev = device if device is not None else self.device_figures(gpu_device if gpu else None)
        dtype_bytes = self._gpu_dtype_bytes(gpu_device) if gpu else 2
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
        mode = mode or DEFAULT_OFFLOAD
        if mode not in ("sparse", "dense"):
            raise InvalidArgumentError(f"offload must be 'sparse' or 'dense', got {mode!r}")
        if mode == "dense":
            opts.sparsity = 0.0
            if device is None and not gpu and self.auto_threads and self.threads > 1:
                # decode steps will leave the row stream's reader a core (reader_cores):
                # predict with the kernels' rate on the threads they will have, if measured
                from edgerun.device.calibration import cached

                dev = cached(self.threads - 1) or dev
        profile = self.neuron_profile(opts.profile) if mode == "sparse" and opts.hot > 0 else None
        bundle = self._bundle_file() if mode == "sparse" else None  # dense streams the GGUF
        offload = None
        if bundle is not None and device is not None:  # a calibrated prediction: time the
            from edgerun.device.calibration import offload_figures  # executors on it too

            offload = offload_figures(bundle, self.threads)

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
                - chat * fp.kv_bytes_per_token
                + max(0, p.budget - p.used_bytes)
                + MARGIN_BYTES
                - KV_LOAN_MARGIN
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

    def predicted_plan(self, threads: int | None = None):
        """The plan of this model's placement (budgets and devices it was loaded with),
        predicted with this machine's calibrated figures at `threads` (measured once and
        cached), and the rows its KV loan holds now: what `edgerun bench` compares its
        measurement to. By default the threads its decode steps run on (fewer where they
        leave the row stream's reader a core)."""
        from edgerun.device.calibration import calibrate

        ram, mode, opts, gpu, gpu_device = self._placement_args
        gpu_dev = gpu_device if gpu is not None else None
        threads = threads or max(1, self.threads - self.governor.decode_reserve)
        figs = calibrate(threads, gpu_device=gpu_dev)
        if ram is None and mode is None and gpu is None:
            ram = 1 << 62  # resident: a budget it fits
        lent = self.kv_loan.lent_bytes if self.kv_loan is not None else 0
        return self.plan_for(ram, mode, opts, gpu, gpu_dev, device=figs, lent_bytes=lent)[0]

    def _bundle_file(self) -> Path | None:
        """This model's flash bundle when it exists (made by the first offloaded run)."""
        from edgerun.offload.bundle import bundle_path, source_sha256

        st = getattr(self.store, "bundle", None)
        if st is not None:
            return Path(st.path)
        m = registry.find_by_file(self.path)
        p = bundle_path(self.path, getattr(m, "sha256", None) or source_sha256(self.path))
        return p if p.exists() else None

    def device_figures(self, gpu_device: str | None = None, measure: bool = False):
        """This machine's measured rates (device/calibration.py): cached ones, measured
        when `measure` or a GPU is asked for and none are cached, else the defaults."""
        from edgerun.device.calibration import cached, calibrate

        figs = cached(self.threads, gpu_device=gpu_device)
        if figs is None and (measure or gpu_device is not None):
            figs = calibrate(self.threads, gpu_device=gpu_device)
        if figs is None:
            from edgerun.offload.plan import DeviceFigures

            figs = DeviceFigures()
        return figs

    def _gpu_dtype_bytes(self, gpu_device: str | None) -> int:
        from edgerun.gpu import resolve_device
        from edgerun.gpu.weights import default_dtype, element_bytes

        return element_bytes(default_dtype(resolve_device(gpu_device or "cuda")))

    def neuron_profile(self, path: str | os.PathLike | None = None):
        """The neuron profile at `path`, else this model's saved one (`edgerun profile`),
        or None when there is none."""
        from edgerun.offload.profile import load_profile

        return load_profile(self, path)

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

        if gpu_budget is not None:
            from edgerun.gpu import resolve_device

            resolve_device(gpu_device)  # a missing torch or device fails before any work
        self.plan, opts = self.plan_for(ram_budget, mode, options, gpu_budget, gpu_device)
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
        if self.plan.mode != "dense":  # sparse calibration runs the resident model first
            self._build_resident()
        if self.plan.mode == "dense":
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
            m = registry.find_by_file(self.path)
            bundle, cal = prepare(self, sha256=getattr(m, "sha256", None))
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
            from edgerun.gpu.place import move_layers

            weights = ResidentStore(self.file, str(self.path))
            self.gpu_placement = [
                move_layers(self.transformer, weights, list(layers), gpu_device, parts=(part,))
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

    def reader_cores(self) -> int:
        """Cores a decode step leaves to the weight readers (sched/cpu_share.ThreadGovernor):
        one where offloading reads FFN weights from flash every token (dense streaming's
        reader threads, sparse mode's I/O threads) and there is a core to spare. Sparse
        mode, Qwen2.5-Coder-1.5B at 800 MiB on 2 vCPUs: 1 compute thread 0.59 / 0.62
        tok/s (I/O wait 1.24-1.28 s a token), 2 threads 0.50 / 0.47 (1.69-1.84 s)."""
        p = self.plan
        streams = p is not None and p.mode in ("dense", "sparse") and p.read_bytes_per_token > 0
        return 1 if streams and self.threads > 1 else 0

    def _after_warm_up(self) -> None:
        """Engine hook of a budgeted load (offload/budget.BudgetKeeper.after_warm_up)."""
        self.budget_keeper.after_warm_up(self.generator.cache, KV_LOAN_MARGIN)

    @property
    def kv_loan(self):
        """offload/kv_loan.KVLoan: rows held on the unwritten KV reserve (None: none)."""
        keeper = self.budget_keeper
        return keeper.kv_loan if keeper is not None else None

    def _build_resident(self) -> None:
        """The Transformer over the file's mapped tensors."""
        self.store = ResidentStore(self.file, str(self.path))
        self.transformer = Transformer(self.spec, self.store, str(self.path))

    def _footprint(self):
        from edgerun.offload.plan import footprint

        return footprint(self.spec, self.file, self.kv_type)

    def minimum_ram_budget(self, mode: str | None = None) -> int:
        """The smallest --ram-budget this model loads with (floor measured in this process)."""
        from edgerun.offload.plan import minimum_budget
        from edgerun.offload.store import OffloadOptions

        return minimum_budget(
            self._footprint(),
            self.floor_bytes,
            self.n_ctx,
            mode or DEFAULT_OFFLOAD,
            allow_predictor=False,
            prefetch=OffloadOptions().prefetch,
        )

    # what the engine holds, by the names the façade's users read
    @property
    def compute_lock(self) -> threading.RLock:
        """One forward at a time: the scheduler thread and direct generate() calls share
        the weights and the kernels' thread pool."""
        return self.engine.lock

    @property
    def prefix_cache(self) -> PrefixCache:
        return self.engine.prefix_cache

    @property
    def kv_budget_tokens(self) -> int | None:
        """The KV positions a RAM budget reserved (one n_ctx window), None without one."""
        return self.engine.kv_budget_tokens

    @kv_budget_tokens.setter
    def kv_budget_tokens(self, n: int | None) -> None:
        self.engine.kv_budget_tokens = n

    def before_kv_write(self, cache: KVCache, end: int) -> None:
        """Engine.before_kv_write: rows lent on the KV reserve go back first."""
        self.engine.before_kv_write(cache, end)

    def offload_stats(self) -> dict | None:
        """Flash reads and the I/O / cache / compute split since the last reset (None when
        the model is resident)."""
        st = getattr(self.store, "offload_stats", None)
        return st() if st else None

    def reset_offload_stats(self) -> None:
        if hasattr(self.store, "reset_offload_stats"):
            self.store.reset_offload_stats()

    # -- sessions and concurrent requests ----------------------------------------
    @property
    def scheduler(self) -> BatchScheduler:
        """The batching scheduler all sessions (and the server) submit to; started on
        first use."""
        return self.serving.scheduler

    def set_max_batch(self, n: int) -> None:
        """How many sequences the scheduler decodes together (default 8)."""
        self.serving.set_max_batch(n)

    def session(self, system: str | None = None, n_ctx: int | None = None) -> Session:
        """A new conversation with its own KV cache (weights are shared)."""
        from edgerun.serving.session import Session

        return Session(self.serving, system=system, n_ctx=n_ctx)

    def load_session(self, path: str | os.PathLike) -> Session:
        """Resume a conversation saved with Session.save (from this model file)."""
        from edgerun.serving.session import Session

        return Session.load(self.serving, path)

    def close(self) -> None:
        """Stop the scheduler thread (cancels what is running) and the weight store's
        reader threads, if it streams. Both start again when the model is used."""
        self.serving.close()
        close_store = getattr(self.store, "close", None)
        if close_store is not None:
            close_store()

    @property
    def identity(self) -> str:
        """What a saved session is checked against (Engine.identity)."""
        return self.engine.identity

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of a conversation rendered with the chat template."""
        return self.engine.encode_chat(messages, add_generation_prompt)

    def _need_template(self) -> None:
        self.engine.need_template()

    # -- introspection --------------------------------------------------------
    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def stats(self) -> GenerationStats:
        return self.generator.stats

    @property
    def chat_template(self) -> str | None:
        return self.tokenizer.chat_template

    def warm_up(self) -> WarmUp:
        """Compile or load the kernels now (once), so no prompt's timing includes it."""
        set_threads(self.governor.threads)
        return self.engine.warm_up()

    def tensor_summary(self) -> list[tuple[str, str, tuple[int, int], int]]:
        out = []
        for name in self.file.tensor_names():
            t = self.file.tensor(name)
            out.append((name, t.qtype.name, t.shape, t.nbytes))
        return out

    # -- tokens ---------------------------------------------------------------
    def tokenize(self, text: str, add_bos: bool | None = None, special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_bos=add_bos, parse_special=special)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """float32 [len(ids), vocab]: the next-token logits after each prefix."""
        ids = [int(i) for i in ids]
        if not ids:
            raise InvalidArgumentError("logits() needs at least one token id")
        check_token_ids(ids, self.spec.vocab_size)
        set_threads(self.threads)
        cache = KVCache(self.spec, len(ids), self.kv_type)
        step = self.prefill_chunk
        parts = [
            self.transformer.forward(ids[i : i + step], cache, all_logits=True)
            for i in range(0, len(ids), step)
        ]
        return np.concatenate(parts, axis=0)

    # -- generation -----------------------------------------------------------
    def generate(
        self,
        prompt: str | Sequence[int],
        max_tokens: int = 256,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        repeat_penalty: float | None = None,
        seed: int | None = None,
        stop: Sequence[str] = (),
    ) -> Iterator[str]:
        """Stream a plain completion of `prompt` (text or token ids)."""
        ids = self.tokenize(prompt) if isinstance(prompt, str) else [int(i) for i in prompt]
        params = self.settings.sampling(
            seed,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repeat_penalty=repeat_penalty,
        )
        return self._stream(ids, params, max_tokens, stop)

    def _stream(self, ids, params, max_tokens, stop) -> Iterator[str]:
        set_threads(self.governor.threads)
        return self.generator.stream(ids, params, max_tokens, stop)

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        self._need_template()
        template = self.tokenizer.chat_template
        tok = self.tokenizer
        return render_chat(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=tok.token_bytes(tok.bos_id).decode("utf-8", "replace"),
            eos_token=tok.token_bytes(tok.eos_id).decode("utf-8", "replace"),
        )

    def with_system(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """`messages` led by the recommended system prompt when they bring none."""
        system = self.settings.system
        if not system or any(m.get("role") == "system" for m in messages):
            return messages
        return [{"role": "system", "content": system}, *messages]

    def chat(
        self,
        messages: list[dict[str, Any]],
        stream: bool = False,
        max_tokens: int = 512,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        repeat_penalty: float | None = None,
        seed: int | None = None,
        stop: Sequence[str] = (),
    ) -> str | Iterator[str]:
        """Answer a conversation ([{"role": ..., "content": ...}, ...]) with the chat template.

        Without a system message, the model's recommended system prompt (if any) leads.
        """
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in messages
        ):
            raise InvalidArgumentError(
                "messages must be a list of dicts with 'role' and 'content' keys"
            )
        ids = self.encode_chat(self.with_system(messages))
        params = self.settings.sampling(
            seed,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repeat_penalty=repeat_penalty,
        )
        it = self._stream(ids, params, max_tokens, stop)
        return it if stream else "".join(it)


def kv_type_for(kv_type: str | None, ram_budget) -> str:
    """The KV cache type asked for, else f32, or f16 under a RAM budget (llama.cpp's
    default): on Qwen2.5-Coder-1.5B at 2048 tokens that is 56 MiB more for held weights."""
    return check_kv_type(kv_type or ("f32" if ram_budget is None else "f16"))


def copies_fit(need: int, headroom: int | None = None) -> tuple[bool, str]:
    """Whether interleaved copies of `need` bytes fit the memory this process has left
    (sysinfo.memory_headroom_bytes: the machine's, or its memory cgroup's), with an
    eighth more for what decode allocates after the load; and why not, when they do
    not. A copy is anonymous memory, which nothing pages out, where the mapped rows it
    replaces are page cache that a tight limit reclaims and reads again (with copies,
    Qwen2.5-1.5B was OOM-killed in an 881 MB cgroup; a model that does not fit at all
    now gets a planned budget first, Model._auto_budget)."""
    if need <= 0:
        return False, ""
    if headroom is None:
        headroom = memory_headroom_bytes()
    want = need + need // 8 + (64 << 20)
    if want <= headroom:
        return True, ""
    return False, (
        f"interleaved decode copies off: they need ~{want >> 20} MiB and "
        f"{headroom >> 20} MiB is left (the row kernels read the mapped file)"
    )


def load(
    model: str | os.PathLike | None = None,
    n_ctx: int | None = None,
    threads: int | None = None,
    auto_pull: bool | None = None,
    kv_type: str | None = None,
    ram_budget: int | str | None = None,
    offload: str | None = None,
    offload_options: dict | None = None,
    context_policy: str = "error",
    gpu_budget: int | str | None = None,
    gpu_device: str = "cuda",
    device_profile=None,
    interleave: bool | None = None,
) -> Model:
    """Load a model by registry name (default: the registry's default), alias or path.

    n_ctx None takes the model's recommended context size (2048 outside the registry).

    kv_type "f16" halves the KV cache's memory (llama.cpp's default); "f32" keeps
    the attention inputs exact. None: f32, or f16 under a ram_budget.

    ram_budget ("800M", "60%", bytes) keeps the whole process, page cache included,
    within that much memory: the FFNs are computed from a bundled flash layout
    (offload "dense", the default: what the budget holds stays in RAM and the rest is
    streamed; or "sparse": only the neurons a token needs, with a windowed cache),
    sized by a placement plan. None: resident where the model fits the memory left
    (the machine's, or its memory cgroup's), else a budget planned for what is left
    (Model.auto_budget_note says so; interleave=False turns that off).

    context_policy "error" (default): a prompt longer than the context is an error and a
    generation that fills it ends ("length"); "slide": attention sinks + a sliding window
    (the first tokens and the newest are kept and recomputed; generate and chat only).

    gpu_budget ("2G", bytes) moves the layers a plan chooses (FFNs first, then attention
    projections) onto torch device `gpu_device` ("cuda", "cuda:1", or "cpu" to run the
    same path on the CPU); needs the extra edgerun[gpu].

    interleave (None: on for a resident GGUF load where the copies fit the memory left,
    `copies_fit`; Model.interleave_note says when they did not) gives the Q4_0, Q4_1,
    Q5_0, Q8_0, Q4_K and Q6_K matrices a 16-row interleaved copy that decode and short
    prompts then read instead of the mapped rows (ops/qmatvec_rows16.py; the vnni
    kernel path only): faster one-session and much faster concurrent decode, about the
    same memory (the mapped rows' pages are let go). False keeps the row kernels, whose
    results a budgeted (offloaded) run of the same model equals bit for bit; the copies
    round differently (README: "Interleaved decode copies").
    """
    if kv_type is not None:
        check_kv_type(kv_type)
    return Model(
        resolve_model(model, auto_pull),
        n_ctx=n_ctx,
        threads=threads,
        kv_type=kv_type,
        ram_budget=ram_budget,
        offload=offload,
        offload_options=offload_options,
        context_policy=context_policy,
        gpu_budget=gpu_budget,
        gpu_device=gpu_device,
        device_profile=device_profile,
        interleave=interleave,
    )


def minimum_ram_budget(
    model: str | os.PathLike | None = None,
    n_ctx: int | None = None,
    mode: str | None = None,
    kv_type: str = "f16",
) -> int:
    """The smallest ram_budget `load` accepts for this model and offload mode (with the
    f16 KV cache a budgeted load takes unless told otherwise)."""
    m = Model(resolve_model(model), n_ctx=n_ctx, kv_type=kv_type, interleave=False)
    return m.minimum_ram_budget(mode)
