"""What a model under a RAM budget does at the engine's moments (engine.EngineHooks).

Once the kernels are loaded: give the C heap's free pages and the page cache the load
left back, page LLVM out and hold the rows the plan deferred to that moment, swap a
streamed head for its sketched one (offload/head.py) and lend the memory the budget
reserves but does not use yet to more streamed rows (offload/kv_loan.py). After each
prompt chunk: give the heap's free pages back. The keeper takes the narrow things it
works on (the plan, the store, the Transformer, the tokenizer, the compute lock), not
the façade.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from edgerun.model.kvcache import KVCache
from edgerun.runtime.sysinfo import current_rss_bytes, return_free_heap_to_os

__all__ = ["KV_LOAN_MARGIN", "BudgetKeeper", "drop_load_page_cache", "trim_heap_after_prompt_chunk"]

# Kept free under a budget when rows are lent on its unused memory (offload/kv_loan.py):
# what the RSS does not show or not yet: the page cache later reads leave and the heap's
# growth (plan.LATE_MEMORY_BYTES), embedding rows a long chat touches
# (plan.EMBEDDING_TOUCH_BYTES), and a decode step's temporaries
KV_LOAN_MARGIN = 32 << 20


def drop_load_page_cache(plan) -> None:
    """Under a budget: drop the page cache loading left (offload/io.drop_own_page_cache);
    a resident plan keeps the model file's, which it reads through the mmap."""
    if plan is None or plan.mode == "resident":
        return
    import numba

    from edgerun.offload.io import drop_own_page_cache

    drop_own_page_cache([numba.config.CACHE_DIR] if numba.config.CACHE_DIR else [])


def trim_heap_after_prompt_chunk() -> None:
    """Under a RAM budget, give the C heap's free pages back after each prompt chunk.
    Why: a chunk's arrays under glibc's 1 MiB mmap threshold (q/k/v, norms: 0.8 MB a
    224-token chunk of Qwen2.5-0.5B) fragment the heap, which grew 91 -> 130 MiB over
    a 1990-token prompt and kept it: the prompt peaked at 436 MB against 419."""
    return_free_heap_to_os()


class BudgetKeeper:
    """The after-warm-up work of one budgeted (offloaded) load; `kv_loan` is the loan it
    made (None: none)."""

    def __init__(
        self,
        plan,
        store,
        transformer,
        tokenizer,
        kv_type: str,
        prefill_chunk: int,
        lock: threading.RLock,
        sketch_dir: Path,
        model_path: Path,
        sha256: str | None = None,
    ) -> None:
        """sketch_dir: where head sketches are kept (the cache directory); model_path and
        sha256: the model file a sketch is keyed by."""
        self.plan = plan
        self.store = store
        self.transformer = transformer
        self.spec = transformer.spec
        self.tokenizer = tokenizer
        self.kv_type = kv_type
        self.prefill_chunk = prefill_chunk
        self.lock = lock
        self.sketch_dir = Path(sketch_dir)
        self.model_path = Path(model_path)
        self.sha256 = sha256
        self.kv_loan = None  # offload/kv_loan.KVLoan: rows held on the unwritten KV reserve

    def after_warm_up(self, live_cache: KVCache | None, kv_loan_margin: int | None = None) -> None:
        """Once the kernels are loaded: drop the page cache the load left and, where the
        plan deferred FFN rows, give LLVM's pages back and hold that many more rows.
        The warm-up's transient allocations leave free pages in the C heap (22 MiB on the
        1.5B at 800M), which glibc keeps unless trimmed. live_cache: the single-stream
        cache the KV loan starts from; kv_loan_margin: bytes kept free beside a loan
        (default KV_LOAN_MARGIN, read when called)."""
        if kv_loan_margin is None:
            kv_loan_margin = KV_LOAN_MARGIN
        return_free_heap_to_os()
        drop_load_page_cache(self.plan)
        store = self.store
        deferred = getattr(self.plan, "deferred_bytes", 0)
        if deferred and hasattr(store, "hold_more"):
            from edgerun.offload.io import page_out_large_libraries

            freed = page_out_large_libraries()
            with self.lock:
                store.hold_more(min(freed, deferred))
        self._sketch_head()
        self._lend_kv_reserve(live_cache, kv_loan_margin)

    def _sketch_head(self) -> None:
        """Where the plan reads only candidate rows of a streamed head: load the head's
        sketch (fit it on calibration text the first time, offload/head.py) and swap
        the streamed head for one that reads the rows it picks."""
        if not self.plan.head_candidates:  # only dense plans of an untied head set it
            return
        from edgerun.corpus import calibration_code, calibration_text
        from edgerun.offload import head as hd

        found = self.store.head_split()
        if found is None:
            return
        m, offset = found
        opts = self.store.options
        first = m.held_rows
        src = self.model_path
        path = hd.sketch_path(
            self.sketch_dir, src, hd.source_key(src, self.sha256), first, opts.head_rank
        )
        with self.lock:
            sketch = hd.load_sketch(path, m.template, first, opts.head_rank)
            if sketch is None:
                # independent windows of one prompt chunk: the KV cache they need is one
                # chunk's (3.6 MiB on the 1.5B), the temporaries the plan's step margin;
                # half prose, half code (a prose-only basis ranked code rows worse)
                # (written into one array: a list of windows and its concatenation held
                # the 6 MiB of states twice at the first run's peak)
                half = hd.CALIBRATION_TOKENS // 2
                step = self.prefill_chunk
                cache = self.transformer.new_cache(step, self.kv_type)
                texts = [
                    self.tokenizer.encode(t[: 16 * half])[:half]
                    for t in (calibration_text(), calibration_code())
                ]
                hidden = np.empty((sum(map(len, texts)), self.spec.d_model), np.float32)
                at = 0
                for ids in texts:
                    for i in range(0, len(ids), step):
                        cache.clear()
                        part = self.transformer.final_hidden(ids[i : i + step], cache)
                        hidden[at : at + len(part)] = part
                        at += len(part)
                del cache, part
                sketch = hd.fit_sketch(
                    m.template, self.store.flash_reader, offset, hidden, first, opts.head_rank
                )
                hd.save_sketch(path, sketch, m.template)
            self.transformer.head = self.store.sketch_head(sketch, opts.head_candidates)

    def _lend_kv_reserve(self, live_cache: KVCache | None, margin: int) -> None:
        """Dense offloading: hold more FFN rows on the memory the budget reserves but the
        process does not use yet (the KV cache's unwritten pages, the prompt step's
        temporaries, the plan's margins), given back before it is needed
        (offload/kv_loan.py)."""
        from edgerun.offload.kv_loan import PAGE_BYTES, KVLoan
        from edgerun.offload.plan import STEP_MARGIN_BYTES

        store, p, spec = self.store, self.plan, self.spec
        tiers = getattr(getattr(store, "options", None), "kv_loan_tiers", 0)
        if not tiers or not hasattr(store, "lend") or self.transformer.kv_growth is not None:
            return
        if store.held_neurons >= spec.d_ff:
            return
        budget = p.budget

        def free_bytes() -> int:
            # what the RSS shows, after the C heap's free pages are given back; the
            # margin covers what it does not (KV_LOAN_MARGIN)
            return_free_heap_to_os()
            return budget - current_rss_bytes() - margin

        with self.lock:
            free = free_bytes()
            if free < PAGE_BYTES * tiers:
                return
            loan = KVLoan(
                store,
                free_bytes,
                KVCache.bytes_for(spec, 1, self.kv_type),
                KVCache.positions_per_page(spec, self.kv_type),
                tier_bytes=free // tiers,
                tiers=tiers,
                step_bytes=STEP_MARGIN_BYTES,
                step_tokens=self.prefill_chunk or 1,
            )
            if live_cache is not None:
                loan.before_forward([live_cache], [live_cache.length], tokens=0)
            self.transformer.kv_growth = loan.before_forward
            loan.lend()
        self.kv_loan = loan
