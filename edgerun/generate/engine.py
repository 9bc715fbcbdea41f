"""Engine (one model's compute, shared by every driver) and the single-stream Generator:
prefill, the decode loop over one Sequence (sequence.py), the context window's policy."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edgerun.errors import ContextOverflowError, EdgerunError, InvalidArgumentError
from edgerun.generate.prefix_cache import PrefixCache
from edgerun.generate.sampling import SamplingParams
from edgerun.generate.sequence import GenerationStats, ResponseStats, Sequence, StopMatcher, WarmUp
from edgerun.generate.settings import ModelSettings
from edgerun.generate.speculative import Speculation
from edgerun.model.kvcache import KVCache
from edgerun.model.transformer import Transformer
from edgerun.ops import lowrank, qmatvec
from edgerun.ops.activations import PARALLEL_MIN as _GLU_PARALLEL_MIN
from edgerun.ops.activations import glu
from edgerun.ops.norm import PARALLEL_MIN as _NORM_PARALLEL_MIN
from edgerun.ops.norm import layernorm, rmsnorm
from edgerun.quant.formats import QuantTensor
from edgerun.runtime.compute_thread import compute_thread
from edgerun.runtime.cpu_share import ThreadGovernor, set_threads
from edgerun.tokenizer import Tokenizer

if TYPE_CHECKING:
    from edgerun.generate.constraint import Constraint

# GenerationStats, ResponseStats, StopMatcher and WarmUp live in sequence.py; the engine
# re-exports them for callers that import them from here.
__all__ = [
    "CONTEXT_POLICIES",
    "DECODE_KERNEL_PARTS",
    "Engine",
    "EngineHooks",
    "GenerationStats",
    "Generator",
    "PREFILL_CHUNK",
    "ResponseStats",
    "StopMatcher",
    "WARM_PARTS",
    "WarmUp",
    "check_prompt",
    "check_token_ids",
    "prefill_chunk_within",
    "verify_bytes_per_row",
    "verify_rows_within",
]

# The warm-up's parts (Engine.warm_part), in the order warm_up runs them.
WARM_PARTS = ("tokenizer", "prompt", "decode", "batch", "gemm", "rows")
# The decode step's kernels one a part, longest compile first (DecodeStep.kernels): a
# first run's processes compile them in parallel before "decode" runs the whole step.
# A model with fewer kernels has empty slots; "decode" compiles any past the last.
DECODE_KERNEL_PARTS = tuple(f"decode:{i}" for i in range(8))
PREFILL_CHUNK = 256  # tokens per forward call: bounds the attention score buffer
# The fewest prompt tokens per forward call a RAM budget may choose.
MIN_PREFILL_CHUNK = 16


def prefill_bytes_per_token(spec) -> int:
    """Bytes of temporaries each prompt token adds to one forward call (activations, the
    gate/up outputs, q/k/v, quantized copies): what a prompt chunk costs beyond the
    weights. Fitted above tracemalloc's peaks of one 128-token forward call on the avx2
    path: SmolLM2 47.9 KB a token, Gemma 3 270M 58.7, Qwen2.5-0.5B 98.4, 1.5B 181.0,
    where this gives 58.4, 73.7, 110.6 and 194.6 (7-25% above); `python
    benchmarks/budget_soak.py` checks the peak a long prompt reaches under a budget."""
    return 8 * spec.d_ff + 64 * spec.d_model + 16 * spec.q_dim


def prefill_chunk_within(spec, nbytes: int) -> int:
    """The prompt tokens per forward call whose temporaries fit in `nbytes` (a budget's
    step margin), a multiple of MIN_PREFILL_CHUNK in [MIN_PREFILL_CHUNK, PREFILL_CHUNK].
    Why: a 256-token chunk of Qwen2.5-1.5B takes 43.5 MiB of temporaries, more than an
    800 MiB budget leaves a long prompt; 128 tokens (22 MiB) prefill as fast there, as
    the streamed weights' reads, not the chunk, set the pace."""
    n = nbytes // prefill_bytes_per_token(spec) // MIN_PREFILL_CHUNK * MIN_PREFILL_CHUNK
    return max(MIN_PREFILL_CHUNK, min(PREFILL_CHUNK, n))


def verify_bytes_per_row(spec) -> int:
    """Bytes of temporaries each row of a speculative verification pass adds: a prompt
    token's (prefill_bytes_per_token) and its float32 logits row, which a verification
    keeps for every row where a prompt chunk keeps only the last."""
    return prefill_bytes_per_token(spec) + 4 * spec.vocab_size


def verify_rows_within(spec, nbytes: int) -> int:
    """The most rows of one verification pass whose temporaries fit in `nbytes` (a
    budget's step margin, less what the draft's own step takes); at least 1, a pass
    without drafts. Qwen2.5-1.5B: 0.8 MB a row (its 151,936 logits are 0.6 of it), so a
    24 MiB margin holds 31 rows, more than any draft length; a 262k-vocabulary model's
    rows are 1.1 MB and more."""
    return max(1, int(nbytes) // verify_bytes_per_row(spec))


# What happens when a prompt or a generation outgrows the context window:
# - "error": a prompt that does not fit raises ContextOverflowError; a generation that fills
#   the window ends with finish_reason "length" (nothing is dropped silently);
# - "slide": attention sinks + sliding window (StreamingLLM, arXiv 2309.17453): the first
#   SINK_TOKENS tokens are kept, the oldest of the rest dropped, and the kept tokens are
#   recomputed at their new positions. A too-long prompt keeps its sinks and its end.
CONTEXT_POLICIES = ("error", "slide")
SINK_TOKENS = 4


def check_prompt(ids: Seq[int], n_ctx: int, vocab_size: int | None = None) -> None:
    """A prompt the model can take: not empty, within the context window, and (given a
    vocabulary size) made of ids inside it. Each failure names the numbers."""
    if not ids:
        raise InvalidArgumentError("the prompt is empty: nothing to condition on")
    if len(ids) > n_ctx:
        raise ContextOverflowError(
            f"the prompt has {len(ids)} tokens but the context window is "
            f"{n_ctx}; use a larger context (-c / n_ctx) or a shorter prompt"
        )
    if vocab_size is not None:
        check_token_ids(ids, vocab_size)


def check_token_ids(ids: Seq[int], vocab_size: int) -> None:
    bad = [i for i in ids if not 0 <= int(i) < vocab_size]
    if bad:
        raise InvalidArgumentError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")


def _weight_matrices(model, layers_only: bool = False) -> list[QuantTensor]:
    """A Transformer's weight matrices, resident or streamed (a streamed matrix's rows
    keep its file's format; a split matrix counts as its template); layers_only: without
    the head."""
    parts: list = (
        [] if layers_only else [getattr(model, "output", None), getattr(model, "head", None)]
    )
    for layer in model.layers:
        parts += [getattr(layer, s, None) for s in type(layer).__slots__]
        ffn = getattr(layer, "ffn", None)
        parts += [getattr(ffn, s, None) for s in getattr(type(ffn), "__slots__", ())]
        parts += list(getattr(ffn, "__dict__", {}).values())
        # an executor whose weights are not its attributes lists them (MoEFFN's experts)
        parts += list(getattr(ffn, "weight_matrices", lambda: [])())
    found = []
    for p in parts:
        p = getattr(p, "matrix", p)  # a streamed head
        p = getattr(p, "template", p)  # a split matrix
        if isinstance(p, QuantTensor) and p.rows > 1:
            found.append(p)
    return found


def _weight_formats(model, rows_only: bool = False) -> set:
    """The formats of a Transformer's weight matrices; rows_only: of those whose decode
    reads their rows (no interleaved copy, qmatvec.interleave)."""
    return {
        w.qtype for w in _weight_matrices(model) if not (rows_only and w.interleaved is not None)
    }


@dataclass
class EngineHooks:
    """What the layer that built the engine does at the engine's moments (a RAM budget's
    bookkeeping: offload/, api.Model); the engine knows nothing else about it."""

    after_warm_up: Callable[[], object] | None = None  # once the kernels are loaded
    after_prompt_chunk: Callable[[], object] | None = None  # after each prompt forward call


class Engine:
    """One loaded model's compute, shared by every driver (the single-stream Generator,
    the batching scheduler, sessions): the Transformer and its tokenizer, the lock that
    keeps one forward pass at a time, the thread governor, the kernels' warm-up, the
    prompt chunk a RAM budget allows, the KV positions it reserves, the shared-prefix
    cache and the budget's hooks."""

    def __init__(
        self,
        transformer: Transformer,
        tokenizer: Tokenizer,
        n_ctx: int,
        kv_type: str = "f32",
        governor: ThreadGovernor | None = None,
        lock: threading.RLock | None = None,
        prefill_chunk: int = PREFILL_CHUNK,
        kv_budget_tokens: int | None = None,
        hooks: EngineHooks | None = None,
        settings: ModelSettings | None = None,
        path: Path | None = None,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        """kv_budget_tokens: the KV positions a RAM budget reserved (one context window;
        concurrent requests share it), None without a budget. path: the model file (or
        pack directory), for the identity a saved session is checked against."""
        if not 1 <= prefill_chunk <= PREFILL_CHUNK:
            raise InvalidArgumentError(
                f"prefill_chunk must be in [1, {PREFILL_CHUNK}], got {prefill_chunk}"
            )
        self.transformer = transformer
        self.spec = transformer.spec
        self.tokenizer = tokenizer
        self.n_ctx = n_ctx
        self.kv_type = kv_type
        self.governor = governor
        # One forward at a time: the scheduler thread and direct generate() calls share
        # the weights and the kernels' thread pool.
        self.lock = lock if lock is not None else threading.RLock()
        self.prefill_chunk = prefill_chunk
        self.kv_budget_tokens = kv_budget_tokens
        self.hooks = hooks if hooks is not None else EngineHooks()
        self.settings = settings if settings is not None else ModelSettings()
        self.path = Path(path) if path is not None else None
        self.prefix_cache = prefix_cache if prefix_cache is not None else PrefixCache()
        self.warmed: WarmUp | None = None
        # Set while other processes still compile the decode step's kernels (the CLI's
        # first run, offload/warm_kernels.KernelPool): called once before the first
        # one-token step (a prompt's last token), so the rest of a prompt runs on its
        # kernels as soon as they are cached.
        self.kernels_pending: Callable[[], object] | None = None
        # True while a first run's children still compile the prompt's kernels: the
        # prompt then goes through the one-token step, whose kernels come first
        # (tools/first_run.py); None once they are cached.
        self.prompt_kernels_pending: Callable[[], bool] | None = None
        self._identity: str | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    def new_cache(self, n_ctx: int | None = None) -> KVCache:
        """An empty KV cache of this model (n_ctx None: the engine's context window)."""
        return self.transformer.new_cache(self.n_ctx if n_ctx is None else n_ctx, self.kv_type)

    # -- the hooks --------------------------------------------------------------------
    def after_prompt_chunk(self) -> None:
        if self.hooks.after_prompt_chunk is not None:
            self.hooks.after_prompt_chunk()

    def before_kv_write(self, cache: KVCache, end: int) -> None:
        """Call before writing a cache's positions up to `end` other than by a forward pass
        (a shared prefix's rows, a saved session's): under a budget, rows lent on the KV
        reserve are given back first (offload/kv_loan.py)."""
        grow = self.transformer.kv_growth
        if grow is not None:
            with self.lock:
                grow([cache], [end], 0)

    # -- warm-up ----------------------------------------------------------------------
    def warm_up(self, parts: Seq[str] | None = None) -> WarmUp:
        """Run every kernel the warm-up `parts` (WARM_PARTS; None: all of them) use once.

        Numba compiles (or loads from its cache) each kernel on first call; doing that
        here keeps it out of the prompt's and the decode's timings. Runs once per Engine;
        later calls return the first result (a kernel a later part would have warmed then
        compiles or loads on its first call). `edgerun generate` passes answer_parts():
        one answer needs under half of the kernels a server does.
        """
        if self.warmed is not None:
            return self.warmed
        from numba.core import event

        t0 = time.perf_counter()
        with self.lock, event.install_recorder("numba:compile") as rec:
            for part in WARM_PARTS if parts is None else parts:
                self.warm_part(part)
        compiled = sum(1 for e in rec.buffer if e[1].is_start)
        self.warmed = WarmUp(time.perf_counter() - t0, compiled)
        if self.hooks.after_warm_up is not None:
            self.hooks.after_warm_up()
        return self.warmed

    def answer_parts(self, prompt_tokens: int) -> tuple[str, ...]:
        """The warm-up parts one answer to a prompt of `prompt_tokens` tokens runs: the
        prompt's kernels (with the GEMMs when some layer matrix takes one at that length:
        past its interleaved copy's batched limit, qmatvec.reads_rows, or its format's,
        qmatvec.mvb_prefill_max) and the decode step's; not the
        batched decode of concurrent requests ("batch", 51 of SmolLM2's 118 s of compile
        CPU) nor the row kernels of offloaded weights ("rows")."""
        n = min(prompt_tokens, self.prefill_chunk)
        gemm = n > 1 and any(
            qmatvec.reads_rows(w, n)  # past its interleaved copy's batched limit
            or (w.interleaved is None and n > qmatvec.mvb_prefill_max(w.qtype))
            for w in _weight_matrices(self.transformer, layers_only=True)
        )
        return (
            ("tokenizer", "prompt", "gemm", "decode") if gemm else ("tokenizer", "prompt", "decode")
        )

    def warm_part(self, part: str) -> None:
        """Run one warm-up part's kernels once (compiling or loading them), on scratch data:

        - "tokenizer": the tokenizer's merge kernel (byte-level BPE, tokenizer/bpe_merges.py);
        - "prompt": a 2-token prompt (the batched decode kernels short prompts take, the
          prefill attention) and the parallel RMSNorm and GLU kernels longer prompts start;
        - "gemm": the prefill GEMM of each weight format (prompts past its batched limit);
        - "decode": one token through the bound decode step (which every prompt's last
          token takes too, Generator.prefill);
        - "decode:i" (DECODE_KERNEL_PARTS): the i-th of that step's kernels alone;
        - "batch": one decode step of two sequences (serving/batching.py);
        - "rows": the row kernels' decode of every format and an offloaded head's sketch
          scores (parts held or moved after the warm-up under a RAM budget).
        """
        model, spec = self.transformer, self.spec
        ids = [1 % spec.vocab_size, 2 % spec.vocab_size]
        with self.lock:
            if part == "tokenizer":
                self.tokenizer.warm()
            elif part == "prompt":
                model.forward(ids, KVCache(spec, 2, self.kv_type))
                compute_thread().call(self._warm_parallel_kernels)
            elif part == "gemm":
                compute_thread().call(qmatvec.warm_prefill, _weight_formats(model))
            elif part == "decode":
                model.forward(ids[-1:], KVCache(spec, 1, self.kv_type))
            elif part in DECODE_KERNEL_PARTS:
                compute_thread().call(self._warm_decode_kernel, DECODE_KERNEL_PARTS.index(part))
            elif part == "batch":
                pair = [KVCache(spec, 1, self.kv_type) for _ in range(2)]
                model.forward_batch(ids, pair)
            elif part == "rows":
                compute_thread().call(self._warm_rows)
            else:
                raise InvalidArgumentError(
                    f"unknown warm-up part {part!r}; expected one of {', '.join(WARM_PARTS)}"
                )

    def _warm_decode_kernel(self, i: int) -> None:
        """Run the i-th kernel of the one-token step once (none past the last)."""
        kernels = self.transformer.decode_kernels(KVCache(self.spec, 1, self.kv_type))
        if i < len(kernels):
            kernel, args = kernels[i]
            kernel(*args)

    def _warm_rows(self) -> None:
        """The row kernels' decode for the matrices without interleaved copies (the copies'
        kernels run in the forward passes), and an offloaded head's sketch scores: parts
        held or moved after the warm-up (offloading) would otherwise load theirs on the
        first token or prompt. Numba keeps what each compile allocated."""
        qmatvec.warm_decode(_weight_formats(self.transformer, rows_only=True))
        lowrank.warm()  # an offloaded head's sketch scores (offload/head.py)

    def _warm_parallel_kernels(self) -> None:
        """Run the parallel norm (RMSNorm or LayerNorm) and GLU kernels once on zero rows
        of the model's width."""
        spec = self.spec
        layer = self.transformer.layers[0]  # its FFN's activation; the output norm's width
        rows = -(-max(_NORM_PARALLEL_MIN, _GLU_PARALLEL_MIN) // spec.d_model)
        x = np.zeros((rows, spec.d_model), np.float32)
        norm = layernorm if spec.norm_kind == "layer" else rmsnorm
        norm(x, self.transformer.output_norm, spec.norm_eps)
        activation = getattr(layer.ffn, "activation", None)
        if activation is not None:
            glu(x, x, activation)

    # -- chat and identity ------------------------------------------------------------
    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of a conversation rendered with the chat template."""
        from edgerun.generate.chat_template import encode_chat

        self.need_template()
        return encode_chat(
            self.tokenizer, messages, self.tokenizer.chat_template, add_generation_prompt
        )

    def need_template(self) -> None:
        if not self.tokenizer.chat_template:
            what = self.path.name if self.path is not None else self.name
            raise EdgerunError(
                f"{what} has no chat template (a base model); use plain completion "
                "(`generate`, or --raw on the command line)"
            )

    @property
    def identity(self) -> str:
        """What a saved session is checked against: the model file's size and the SHA-256
        of its first MiB (the header: metadata, tensor table), plus the KV layout."""
        if self._identity is None:
            h = hashlib.sha256()
            path = self.path
            files = [] if path is None else sorted(path.iterdir()) if path.is_dir() else [path]
            for f in files:
                if f.is_file():
                    h.update(f"{f.name}:{f.stat().st_size}\n".encode())
                    with open(f, "rb") as fh:
                        h.update(fh.read(1 << 20))
            s = self.spec
            h.update(f"{s.n_layers}/{s.n_kv_heads}/{s.head_dim}/{s.vocab_size}".encode())
            self._identity = h.hexdigest()[:32]
        return self._identity


class Generator:
    """The single-stream driver: runs an Engine over one KV cache, reusing the cached
    prefix of each prompt."""

    def __init__(self, engine: Engine, context_policy: str = "error") -> None:
        if context_policy not in CONTEXT_POLICIES:
            raise InvalidArgumentError(
                f"context_policy must be one of {', '.join(CONTEXT_POLICIES)}, "
                f"got {context_policy!r}"
            )
        self.engine = engine
        self.context_policy = context_policy
        self.cache = engine.new_cache()
        self.stats = GenerationStats()
        self.kernel_wait_s = 0.0  # time _kernels_ready waited, kept out of prompt timings
        # drafts and their verification (generate/speculative.py); None: one token a pass
        self.speculation: Speculation | None = None

    # what the engine holds, by the names the generator's users read
    @property
    def model(self) -> Transformer:
        return self.engine.transformer

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def lock(self) -> threading.RLock:
        return self.engine.lock

    @property
    def governor(self) -> ThreadGovernor | None:
        return self.engine.governor

    @governor.setter
    def governor(self, g: ThreadGovernor | None) -> None:
        self.engine.governor = g

    @property
    def prefill_chunk(self) -> int:
        return self.engine.prefill_chunk

    @property
    def warmed(self) -> WarmUp | None:
        return self.engine.warmed

    def warm_up(self) -> WarmUp:
        return self.engine.warm_up()

    def _pace(self, decode: bool) -> None:
        """Follow the governor's thread count for the next pass (it changes when other
        load does, and between prompt chunks and decode steps of a streamed model)."""
        g = self.governor
        if g is not None:
            g.update()
            n = g.step_threads(decode)
            set_threads(n)  # a few microseconds; other callers may have set another count
            self.stats.threads = n

    def prefill(self, ids: Seq[int]) -> np.ndarray:
        """Make the cache hold exactly `ids`; return the last position's logits."""
        ids = list(ids)
        if len(ids) > self.cache.n_ctx and self.context_policy == "slide":
            ids = self._slid(ids, self.cache.n_ctx - max(1, self.cache.n_ctx // 4))
        check_prompt(ids, self.cache.n_ctx)
        # a hybrid model's states go back only to kept positions (KVCache.reusable)
        reuse = self.cache.reusable(min(self.cache.common_prefix(ids), len(ids) - 1))
        self.cache.truncate(reuse)
        # The last prompt token always goes through the one-token decode path, so
        # its logits do not depend on how much of the prompt was cached: batched and
        # single-token kernels round differently, and a seed must give the same text.
        self._forward_chunks(ids[reuse:-1])
        self._pace(decode=True)
        self._kernels_ready()
        with self.lock:
            return self.model.forward(ids[-1:], self.cache)

    def _kernels_ready(self) -> None:
        """Wait, once, for decode kernels other processes still compile (kernels_pending)."""
        pending, self.engine.kernels_pending = self.engine.kernels_pending, None
        if pending is not None:
            t0 = time.perf_counter()
            pending()
            self.kernel_wait_s += time.perf_counter() - t0

    def _forward_chunks(self, ids: list[int]) -> None:
        """Append `ids` to the cache, prefill_chunk tokens per forward call (one token a
        call while a first run still compiles the prompt's kernels)."""
        step = self.prefill_chunk
        i = 0
        while i < len(ids):
            n = 1 if self._prompt_kernels_pending() else step
            self._pace(decode=n == 1)
            with self.lock:
                self.model.forward(ids[i : i + n], self.cache)
                self.engine.after_prompt_chunk()
            i += n

    def _prompt_kernels_pending(self) -> bool:
        """Whether other processes still compile the prompt's kernels (a first run): the
        prompt's tokens then take the one-token step one by one, once its kernels are
        ready; the rest of the prompt takes its own kernels once they are."""
        pending = self.engine.prompt_kernels_pending
        if pending is None:
            return False
        if pending():
            self._kernels_ready()
            return True
        self.engine.prompt_kernels_pending = None
        return False

    @staticmethod
    def _slid(ids: list[int], keep: int) -> list[int]:
        """The sinks and the last tokens of `ids`, `keep` in all."""
        sinks = min(SINK_TOKENS, keep // 2)
        return ids[:sinks] + ids[len(ids) - (keep - sinks) :]

    def _slide(self) -> None:
        """Make room in a full window: keep the sinks and the newest half, recompute them."""
        kept = self._slid(list(self.cache.tokens), self.cache.n_ctx // 2)
        self.cache.clear()
        self._forward_chunks(kept)
        self.stats.slides += 1

    def stream(
        self,
        prompt_ids: Seq[int],
        params: SamplingParams,
        max_tokens: int = 256,
        stop: Seq[str] = (),
        stop_ids: Seq[int] | None = None,
        constraint: Constraint | None = None,
    ) -> Iterator[str]:
        """Yield text pieces as they are decoded. Stats land in self.stats.
        constraint: a grammar the output follows (generate/constraint.py)."""
        if max_tokens < 0:
            raise InvalidArgumentError(f"max_tokens must be >= 0, got {max_tokens}")
        t_start = time.perf_counter()
        fresh = self.warmed is None
        warmup = self.warm_up()
        stats = self.stats = GenerationStats(
            prompt_tokens=len(prompt_ids), warmup=warmup if fresh else None
        )
        if self.governor is not None:
            stats.threads = self.governor.threads
        reusable = min(self.cache.common_prefix(list(prompt_ids)), len(prompt_ids) - 1)
        stats.cached_tokens = self.cache.reusable(reusable)
        t0 = time.perf_counter()
        logits = self.prefill(prompt_ids)
        stats.prompt_seconds = time.perf_counter() - t0 - self.kernel_wait_s
        self.kernel_wait_s = 0.0
        eos = self.tokenizer.eos_ids if stop_ids is None else stop_ids
        seq = Sequence(
            self.tokenizer,
            params,
            prompt_ids,
            max_tokens,
            stop,
            eos,
            stats,
            started=t_start,
            constraint=constraint,
        )
        t1 = time.perf_counter()
        stats.finish_reason = "length"
        try:
            if max_tokens and self.speculation is not None:
                yield from self.speculation.decode(self, seq, logits)
            while max_tokens and not seq.done:
                text = seq.step(logits)
                if text:
                    yield text
                if seq.done:
                    break
                if self.cache.room() == 0:
                    if self.context_policy != "slide":
                        seq.end("length")  # context full
                        break
                    self._slide()
                self._pace(decode=True)
                self._kernels_ready()
                with self.lock:
                    logits = self.model.forward([seq.token], self.cache)
                stats.generate_seconds = time.perf_counter() - t1
            seq.end("length")
            tail = seq.tail()
            if tail:
                yield tail
        except (GeneratorExit, KeyboardInterrupt):
            stats.finish_reason = "cancelled"
            raise
        finally:
            stats.generate_seconds = time.perf_counter() - t1
