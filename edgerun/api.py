"""The embeddable API: load a model by registry name or path, then tokenize,
score, generate and chat."""

from __future__ import annotations

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
from edgerun.errors import BudgetError, InvalidArgumentError, ModelNotFoundError
from edgerun.formats.gguf import read_gguf
from edgerun.generate.chat_template import render_chat
from edgerun.generate.constraint import constraint_from, response_format_constraint
from edgerun.generate.engine import (
    PREFILL_CHUNK,
    Engine,
    EngineHooks,
    Generator,
    check_token_ids,
    prefill_chunk_within,
    verify_bytes_per_row,
    verify_rows_within,
)
from edgerun.generate.sequence import GenerationStats, WarmUp
from edgerun.generate.settings import ModelSettings
from edgerun.generate.speculative import ModelDrafter, NgramDrafter, Speculation
from edgerun.model.kvcache import kv_type_asked
from edgerun.model.transformer import Transformer
from edgerun.offload.budget import KV_LOAN_MARGIN, trim_heap_after_prompt_chunk
from edgerun.offload.loader import (
    DEFAULT_OFFLOAD,
    KERNEL_FLOOR_BYTES,
    KERNEL_PAGED_OUT_BYTES,
    LOAN_CHAT_TOKENS,
    Loader,
    LoaderHooks,
    kv_type_for,
    runtime_floor_bytes,
)
from edgerun.offload.plan import parse_budget
from edgerun.runtime.cpu_share import ThreadGovernor, set_threads, wait_policy_spins
from edgerun.runtime.sysinfo import (
    anonymous_rss_bytes,
    default_threads,
    memory_headroom_bytes,
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


def resolve_draft(
    model: str | os.PathLike, form: str = "auto", auto_pull: bool | None = None
) -> Path:
    """A draft model (registry name, alias or path) -> the path to load for drafting: its
    cheap form (generate/draft_forms.py; "auto": the measured fastest that still agrees,
    "source": the file as it is), made once under the cache's drafts/ and reused. A pack
    directory is taken as it is."""
    from edgerun.generate.draft_forms import cheap_draft

    path = resolve_model(model, auto_pull)
    if path.is_dir():
        return path
    return cheap_draft(path, form, cache_dir=registry.cache_dir() / "drafts", progress=True)


def settings_for(path: str | os.PathLike) -> ModelSettings:
    """The recommended settings of the registry model whose file `path` is, else the defaults."""
    m = registry.find_by_file(path)
    return m.parameters if m is not None else ModelSettings()


if TYPE_CHECKING:
    from edgerun.offload.plan import Plan
    from edgerun.serving.session import Session

# Re-exported: planning's constants and helpers live in offload/loader.py (and the loan's
# margin in offload/budget.py, read when the loan is made)
__all__ = [
    "DEFAULT_OFFLOAD",
    "KERNEL_FLOOR_BYTES",
    "KERNEL_PAGED_OUT_BYTES",
    "KV_LOAN_MARGIN",
    "LOAN_CHAT_TOKENS",
    "Model",
    "copies_fit",
    "kv_type_for",
    "load",
    "loader_hooks",
    "minimum_ram_budget",
    "resolve_model",
    "runtime_floor_bytes",
    "settings_for",
]


def loader_hooks() -> LoaderHooks:
    """What offload/loader.Loader needs from device/ (this machine's measured figures)
    and gpu/ (the torch device), looked up when called."""
    from edgerun.device import calibration

    def resolve_gpu(dev):
        from edgerun.gpu import resolve_device

        return resolve_device(dev)

    def gpu_dtype_bytes(dev) -> int:
        from edgerun.gpu import resolve_device
        from edgerun.gpu.weights import default_dtype, element_bytes

        return element_bytes(default_dtype(resolve_device(dev)))

    def move_layers(transformer, weights, layers, dev, parts):
        from edgerun.gpu.place import move_layers

        return move_layers(transformer, weights, layers, dev, parts=parts)

    return LoaderHooks(
        cached_figures=lambda t, g=None: calibration.cached(t, gpu_device=g),
        calibrate=lambda t, g=None: calibration.calibrate(t, gpu_device=g),
        offload_figures=lambda b, t: calibration.offload_figures(b, t),
        resolve_gpu=resolve_gpu,
        gpu_dtype_bytes=gpu_dtype_bytes,
        move_layers=move_layers,
    )


class Model:
    """A loaded model with its tokenizer and one conversation's KV cache.

    Sampling arguments, n_ctx and the system prompt left as None take the model's
    recommended settings (`self.settings`: its registry manifest's [parameters]).
    `engine` (generate/engine.Engine) holds the compute every driver shares, `loader`
    (offload/loader.Loader) the placement: plan, weight store, the planning behind them.
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
        prof = None
        if device_profile is not None:  # emulate a smaller device: caps, slow storage
            from edgerun.device.profile import DeviceProfile, load_device_profile

            prof = device_profile
            if not isinstance(prof, DeviceProfile):
                prof = load_device_profile(prof)
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
        self.path = Path(path)
        self.settings = settings if settings is not None else settings_for(self.path)
        if n_ctx is None:
            n_ctx = self.settings.n_ctx
        if self.path.is_dir():  # an edgerun pack (edgerun convert)
            from edgerun.formats.pack import read_pack

            file = read_pack(self.path)
            self.spec = file.spec
            self.tokenizer: Tokenizer = file.tokenizer()
        else:
            file = read_gguf(self.path)
            meta = file.metadata
            self.spec = spec_from_gguf(meta, str(self.path))
            self.tokenizer = tokenizer_from_gguf_metadata(meta)
        if n_ctx <= 0:
            n_ctx = self.spec.context_length
        self.n_ctx = min(n_ctx, self.spec.context_length)
        if self.tokenizer.chat_template:  # untrusted: compiled (and checked) once, here
            from edgerun.generate.chat_template import check_template

            check_template(self.tokenizer.chat_template)
        n_threads = threads or default_threads()
        if n_threads < 1:
            raise InvalidArgumentError(f"threads must be >= 1, got {n_threads}")
        # Under a RAM budget a prompt chunk's temporaries must fit in the plan's step
        # margin (a sparse load's calibration runs in such chunks too)
        prefill_chunk = PREFILL_CHUNK
        if ram_budget is not None:
            from edgerun.offload.plan import STEP_MARGIN_BYTES

            prefill_chunk = prefill_chunk_within(self.spec, STEP_MARGIN_BYTES)
        loader = self.loader = Loader(
            self.path,
            file,
            self.spec,
            self.tokenizer,
            self.n_ctx,
            kv_type_for(kv_type, ram_budget),
            n_threads,
            auto_threads=threads is None,
            floor_bytes=runtime_floor_bytes(),
            device_profile=prof,
            prefill_chunk=prefill_chunk,
            hooks=loader_hooks(),
        )
        # A default load of a GGUF sizes itself to the memory left (measured once): where
        # the model does not fit, it plans for what is left as --ram-budget would
        # (Loader.auto_budget); where it does, it makes the interleaved copies that fit
        # (copies_fit). The loader's notes say what it did.
        headroom = None
        placed = ram_budget is not None or offload is not None or gpu_budget is not None
        if not placed and interleave is None and hasattr(file, "release_pages"):
            headroom = memory_headroom_bytes()
            ram_budget, loader.auto_budget_note = loader.auto_budget(
                kv_type, headroom, anonymous_rss_bytes()
            )
            if ram_budget is not None:
                from edgerun.offload.plan import STEP_MARGIN_BYTES

                loader.prefill_chunk = prefill_chunk_within(self.spec, STEP_MARGIN_BYTES)
        offloading = placed or ram_budget is not None  # given, or planned just now
        if interleave and offloading:
            raise InvalidArgumentError(
                "interleave=True: the interleaved decode copies are for resident models, "
                "not with ram_budget, offload or gpu_budget"
            )
        set_threads(n_threads)
        # Automatic threads follow the cores other processes leave free (runtime/cpu_share.py);
        # a count the caller chose is kept as is.
        governor = ThreadGovernor(
            n_threads, default_threads(), adaptive=threads is None and wait_policy_spins()
        )
        if not offloading:
            transformer = loader.build_resident()
            # the interleaved decode copies (qmatvec_rows16; resident loads on the vnni
            # path unless interleave=False). By default only where the mapped rows' pages
            # can be let go (a GGUF), so the copies cost no memory, and where they fit in
            # the memory left (copies_fit).
            if headroom is not None:
                need = transformer.interleave_bytes()
                interleave, loader.interleave_note = copies_fit(need, headroom)
            if interleave:
                loader.interleaved_bytes = transformer.interleave_weights()
        else:
            transformer = loader.place(ram_budget, offload, offload_options, gpu_budget, gpu_device)
            if loader.auto_threads:
                governor.decode_reserve = loader.reader_cores()
        lock = threading.RLock()
        keeper = loader.keeper(lock) if offloading else None
        # What every driver (generate, sessions, the server) shares. Under a RAM budget the
        # plan reserves one n_ctx window of KV cache; concurrent requests share it
        # (serving/batching.BatchScheduler admits by it).
        self.engine = Engine(
            transformer,
            self.tokenizer,
            self.n_ctx,
            loader.kv_type,
            governor,
            lock=lock,
            prefill_chunk=loader.prefill_chunk,
            kv_budget_tokens=self.n_ctx if ram_budget is not None else None,
            hooks=EngineHooks(
                after_warm_up=(
                    (lambda: keeper.after_warm_up(self.generator.cache))
                    if keeper is not None
                    else None
                ),
                after_prompt_chunk=trim_heap_after_prompt_chunk if ram_budget is not None else None,
            ),
            settings=self.settings,
            path=self.path,
        )
        self.generator = Generator(self.engine, context_policy=context_policy)
        self.serving = Serving(self.engine)
        self.load_seconds = time.perf_counter() - t0

    # -- the placement and the compute, by the names the façade's users read --------
    @property
    def plan(self) -> Plan | None:
        """Where the weights live (offload/plan.Plan); None for a plain resident load."""
        return self.loader.plan

    @property
    def store(self):
        return self.loader.store

    @property
    def file(self):
        return self.loader.file

    @property
    def transformer(self) -> Transformer:
        return self.engine.transformer

    @property
    def kv_type(self) -> str:
        return self.engine.kv_type

    @property
    def threads(self) -> int:
        return self.loader.threads

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
        self.loader.close()

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

    def warm_up(self, parts: Sequence[str] | None = None) -> WarmUp:
        """Compile or load the kernels now (once), so no prompt's timing includes it.

        parts: the warm-up parts to run (engine.WARM_PARTS; None: all, what a server
        needs); `engine.answer_parts(n)` names those one answer to an n-token prompt uses."""
        set_threads(self.engine.governor.threads)
        return self.engine.warm_up(parts)

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
        cache = self.transformer.new_cache(len(ids), self.kv_type)
        step = self.engine.prefill_chunk
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
        draft: Any = None,
        json_schema: dict | str | None = None,
        regex: str | None = None,
        grammar: str | None = None,
    ) -> Iterator[str]:
        """Stream a plain completion of `prompt` (text or token ids). draft: this call's
        drafter (as load's draft_model; "none": no drafts), None: the model's.

        json_schema (a dict or JSON text), regex or grammar (Lark or GBNF): the output
        follows it (needs `pip install 'edgerun[structured]'`); the text ends where the
        grammar is complete. A bad one raises InvalidArgumentError before any token."""
        constraint = constraint_from(self.tokenizer, json_schema, regex, grammar)
        ids = self.tokenize(prompt) if isinstance(prompt, str) else [int(i) for i in prompt]
        params = self.settings.sampling(
            seed,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repeat_penalty=repeat_penalty,
        )
        return self._stream(ids, params, max_tokens, stop, draft, constraint)

    def _stream(self, ids, params, max_tokens, stop, draft=None, constraint=None) -> Iterator[str]:
        set_threads(self.engine.governor.threads)
        self.generator.speculation = self.draft if draft is None else self.speculation(draft)
        if constraint is None:
            return self.generator.stream(ids, params, max_tokens, stop)
        return self.generator.stream(ids, params, max_tokens, stop, constraint=constraint)

    # -- speculative decoding (generate/speculative.py) ---------------------------
    draft: Speculation | None = None  # the drafter generate and chat use by default
    _drafts: dict | None = None  # drafters built for a call's draft=, by what was asked

    def set_draft(self, draft_model: Any = None, num_draft_tokens: int | None = None) -> None:
        """Draft tokens for generate and chat from now on: "ngram" (prompt lookup), a
        registry name or path of a model with the same vocabulary, a loaded Model, or
        None / "none" for none. num_draft_tokens: the longest draft (the length adapts
        below it to the acceptance; default 16 for n-gram, 5 for a model: DEFAULT_DRAFT_TOKENS)."""
        self.draft = self.speculation(draft_model, num_draft_tokens)
        # sessions and the server draft too, for a request while it runs alone
        self.serving.speculation = self.draft
        if self.serving.running:
            self.serving.scheduler.speculation = self.draft

    def speculation(
        self, draft_model: Any, num_draft_tokens: int | None = None
    ) -> Speculation | None:
        """The Speculation for a draft_model as set_draft takes it (made once per draft
        and length, then reused: a draft model keeps its weights and KV cache)."""
        if draft_model is None or draft_model is False or draft_model == "none":
            return None
        if isinstance(draft_model, Speculation):
            return draft_model
        key = (id(draft_model) if isinstance(draft_model, Model) else str(draft_model),
               num_draft_tokens)  # fmt: skip
        if self._drafts is None:
            self._drafts = {}
        made = self._drafts.get(key)
        if made is None:
            if draft_model == "ngram":
                drafter = NgramDrafter()
            else:
                other = _draft_model(draft_model, self.n_ctx, self.loader.threads, self.kv_type)
                drafter = ModelDrafter(other.engine, other.path.name)
                drafter.check_vocabulary(self.engine, self.path.name)
                drafter.resident_bytes = other.memory_bytes()
                drafter.owner = other  # keeps the draft Model (and its file) alive
            made = self._drafts[key] = Speculation(drafter, num_draft_tokens)
            self._fit_to_plan(made)
        return made

    def _fit_to_plan(self, speculation: Speculation) -> None:
        plan = self.loader.plan
        if plan is not None:
            fit_to_plan(speculation, plan, self.spec, self.loader.device_figures())

    def memory_bytes(self) -> int:
        """About the memory this model keeps resident: its file's bytes, or the planned
        budget's, and its KV cache's."""
        plan = self.loader.plan
        if plan is not None and getattr(plan, "budget", None):
            return int(plan.budget)
        return self.loader.model_bytes + self.generator.cache.nbytes

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
        draft: Any = None,
        response_format: dict | None = None,
        regex: str | None = None,
        grammar: str | None = None,
        tools: list[dict] | None = None,
        tool_choice: str | dict | None = None,
        reasoning: str | int | bool | None = None,
        message: bool = False,
    ) -> str | Iterator[str] | dict | Iterator[dict]:
        """Answer a conversation ([{"role": ..., "content": ...}, ...]) with the chat template.

        Without a system message, the model's recommended system prompt (if any) leads.
        draft: this call's drafter (as load's draft_model; "none": no drafts), None: the
        model's.
        response_format (OpenAI's shape): {"type": "json_schema", "json_schema": {"name":
        ..., "schema": {...}}}, {"type": "json_object"} or {"type": "text"}; the answer
        follows it (needs `pip install 'edgerun[structured]'`); regex or grammar (Lark or
        GBNF) constrain it the same way.
        tools / tool_choice: OpenAI's (the model's template shows the tools, its markup is
        read back as calls; "required" or a named function forces a valid call). reasoning:
        "on", "off", or a budget of N reasoning tokens (None: the template's default).
        message=True answers with the assistant message (content, reasoning_content,
        tool_calls, finish_reason) instead of text; streamed, with OpenAI's delta dicts
        and a last {"finish_reason": ...}.
        """
        constraint = response_format_constraint(self.tokenizer, response_format)
        if regex is not None or grammar is not None:
            if constraint is not None:
                raise InvalidArgumentError("give response_format or regex/grammar, not both")
            constraint = constraint_from(self.tokenizer, regex=regex, grammar=grammar)
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and "role" in m and ("content" in m or "tool_calls" in m)
            for m in messages
        ):
            raise InvalidArgumentError(
                "messages must be a list of dicts with 'role' and 'content' keys"
            )
        params = self.settings.sampling(
            seed,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repeat_penalty=repeat_penalty,
        )
        if tools is None and tool_choice is None and reasoning is None and not message:
            ids = self.encode_chat(self.with_system(messages))
            it = self._stream(ids, params, max_tokens, stop, draft, constraint)
            return it if stream else "".join(it)
        return self._chat_turn(
            messages, stream, max_tokens, params, stop, tools, tool_choice, reasoning, message,
            draft, constraint,
        )  # fmt: skip

    def _chat_turn(
        self, messages, stream, max_tokens, params, stop, tools, tool_choice, reasoning, message,
        draft=None, constraint=None,
    ):  # fmt: skip
        """chat() with tools, a reasoning mode or message answers (generate/chat_turn.py)."""
        from edgerun.generate.chat_turn import prepare_turn
        from edgerun.generate.reasoning import BudgetedGeneration

        self._need_template()
        turn = prepare_turn(
            self.tokenizer, self.with_system(messages), tools, tool_choice, reasoning
        )
        constraint = turn.constraint(self.tokenizer, constraint)
        if turn.reasoning.budget is not None:
            if constraint is not None:
                raise InvalidArgumentError(
                    "a reasoning budget cannot be combined with response_format, a grammar "
                    "or a forced tool call"
                )
            gen = BudgetedGeneration(
                lambda ids, n, cache: self.scheduler.submit(ids, params, n, stop, cache=cache),
                turn.ids,
                max_tokens,
                turn.reasoning.budget,
                turn.close_ids,
                turn.opens_reasoning,
            )

            def budgeted() -> Iterator[str]:
                yield from gen
                # Model.stats tells of this turn, as after the generator's own turns
                self.generator.stats = gen.stats

            it, stats = budgeted(), (lambda: gen.stats)
        else:
            it = self._stream(turn.ids, params, max_tokens, stop, draft, constraint)
            stats = lambda: self.stats  # noqa: E731
        if not message:
            return it if stream else "".join(it)
        reader = turn.reader()

        def deltas() -> Iterator[dict]:
            for piece in it:
                yield from reader.feed(piece)
            yield from reader.finish()
            yield {"finish_reason": reader.finish_reason(stats().finish_reason)}

        if stream:
            return deltas()
        end = list(deltas())[-1]
        return {**reader.message(), **end}

    # -- embeddings -----------------------------------------------------------
    def embed(
        self, texts: str | Sequence[str], pooling: str | None = None, normalize: bool = True
    ) -> np.ndarray:
        """Embeddings float32 [len(texts), d_model] (a str: one row): each text's final
        hidden states pooled, "last" (token), "mean" or "cls" (first token); None: the
        file's pooling_type, else the family's default (last). normalize: unit L2 norm.
        Short texts share forward passes (generate/embedding.py)."""
        from edgerun.generate.embedding import embed_ids, text_tokens

        items = [texts] if isinstance(texts, str) else list(texts)
        if not all(isinstance(t, str) for t in items):
            raise InvalidArgumentError("embed() takes a string or a list of strings")
        ids = [text_tokens(self.tokenizer, t) for t in items]
        return embed_ids(self.engine, ids, pooling, normalize)


def copies_fit(need: int, headroom: int | None = None) -> tuple[bool, str]:
    """Whether interleaved copies of `need` bytes fit the memory this process has left
    (sysinfo.memory_headroom_bytes: the machine's, or its memory cgroup's), with an
    eighth more for what decode allocates after the load; and why not, when they do
    not. A copy is anonymous memory, which nothing pages out, where the mapped rows it
    replaces are page cache that a tight limit reclaims and reads again (with copies,
    Qwen2.5-1.5B was OOM-killed in an 881 MB cgroup; a model that does not fit at all
    gets a planned budget first, offload/loader.Loader.auto_budget)."""
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
    kv_type_k: str | None = None,
    kv_type_v: str | None = None,
    ram_budget: int | str | None = None,
    offload: str | None = None,
    offload_options: dict | None = None,
    context_policy: str = "error",
    gpu_budget: int | str | None = None,
    gpu_device: str = "cuda",
    device_profile=None,
    interleave: bool | None = None,
    draft_model: Any = None,
    num_draft_tokens: int | None = None,
) -> Model:
    """Load a model by registry name (default: the registry's default), alias or path.

    n_ctx None takes the model's recommended context size (2048 outside the registry).

    kv_type "f16" halves the KV cache's memory (llama.cpp's default); "f32" keeps
    the attention inputs exact; "q8_0" (34/64 of f16's bytes) and "q4_0" (18/64) hold
    ggml's 32-value blocks, which attention reads in place (head_dim a multiple of 32).
    None: f32, or f16 under a ram_budget. kv_type_k / kv_type_v set the keys' and the
    values' types apart (llama.cpp's -ctk / -ctv; the side not given: kv_type, else f16).

    ram_budget ("800M", "60%", bytes) keeps the whole process, page cache included,
    within that much memory: the FFNs are computed from a bundled flash layout
    (offload "dense", the default: what the budget holds stays in RAM and the rest is
    streamed; or "sparse": only the neurons a token needs, with a windowed cache),
    sized by a placement plan. None: resident where the model fits the memory left
    (the machine's, or its memory cgroup's), else a budget planned for what is left
    (Model.loader.auto_budget_note says so; interleave=False turns that off).

    context_policy "error" (default): a prompt longer than the context is an error and a
    generation that fills it ends ("length"); "slide": attention sinks + a sliding window
    (the first tokens and the newest are kept and recomputed; generate and chat only).

    gpu_budget ("2G", bytes) moves the layers a plan chooses (FFNs first, then attention
    projections) onto torch device `gpu_device` ("cuda", "cuda:1", or "cpu" to run the
    same path on the CPU); needs the extra edgerun[gpu].

    interleave (None: on for a resident GGUF load where the copies fit the memory left,
    `copies_fit`; Model.loader.interleave_note says when they did not) gives the Q4_0, Q4_1,
    Q5_0, Q8_0, Q4_K and Q6_K matrices a 16-row interleaved copy that decode and short
    prompts then read instead of the mapped rows (ops/qmatvec_rows16.py; the vnni
    kernel path only): faster one-session and much faster concurrent decode, about the
    same memory (the mapped rows' pages are let go). False keeps the row kernels, whose
    results a budgeted (offloaded) run of the same model equals bit for bit; the copies
    round differently (README: "Interleaved decode copies").

    draft_model (speculative decoding, exact: the output equals decoding without it,
    token for token): "ngram" (prompt lookup: continuations already in the prompt and
    the text so far), or a registry name, path or loaded Model of a smaller model with the
    same vocabulary (e.g. qwen2.5-coder-0.5b for qwen2.5-coder-1.5b); a draft model of
    another vocabulary is refused. num_draft_tokens: the longest draft (adaptive below
    it). Model.set_draft changes it later; generate / chat take draft= per call.
    """
    kv_type = kv_type_asked(kv_type, kv_type_k, kv_type_v)
    draft_bytes = 0
    if ram_budget is not None and resident_draft(draft_model):
        draft_model, ram_budget, draft_bytes = draft_within_budget(
            draft_model, ram_budget, n_ctx, kv_type, threads
        )
    try:
        model = Model(
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
    except BudgetError as e:
        if not draft_bytes:
            raise
        raise BudgetError(
            f"{e} (what the RAM budget leaves after the draft model's {draft_bytes >> 20} MiB; "
            "use ngram drafts, a smaller draft, or a larger budget)"
        ) from None
    if draft_model is not None:
        model.set_draft(draft_model, num_draft_tokens)
    return model


def resident_draft(draft_model: Any) -> bool:
    """Whether a draft_model as load takes it is a model (resident weights and KV cache),
    not n-gram drafts or none."""
    if draft_model is None or draft_model is False or isinstance(draft_model, Speculation):
        return False
    return not (isinstance(draft_model, str) and draft_model in ("ngram", "none"))


def _draft_model(draft_model: Any, n_ctx: int | None, threads, kv_type: str | None) -> Model:
    """The draft model a draft_model names (a registry name, draft form or path), loaded
    resident; a loaded Model as it is."""
    if isinstance(draft_model, Model):
        return draft_model
    return Model(resolve_draft(draft_model), n_ctx=n_ctx, threads=threads, kv_type=kv_type)


def fit_to_plan(speculation: Speculation, plan: Plan, spec, figures) -> None:
    """Size a speculation for a RAM budget's plan: verification rows whose temporaries fit
    the step margin beside the draft model's own step; where weights stream, the plan's
    predicted pass costs as DraftLength's first prices (streamed weights make extra rows
    nearly free) and a resident draft's step priced against the streamed pass.
    Measured passes replace the predictions. spec: the target's ModelSpec; figures: the
    DeviceFigures the plan was made with."""
    from edgerun.offload.plan import STEP_MARGIN_BYTES

    margin = STEP_MARGIN_BYTES
    engine = getattr(speculation.drafter, "engine", None)
    if engine is not None:  # the draft model's one-token step shares the margin
        margin -= verify_bytes_per_row(engine.spec)
    rows = verify_rows_within(spec, margin)
    length = speculation.length
    if plan.mode == "resident":  # the resident kernels' passes are measured, not predicted
        speculation.fit(rows)
        return
    rows = min(rows, length.max_tokens + 1)
    speculation.fit(rows, plan.pass_costs(rows, length.row_cost))
    owner = getattr(speculation.drafter, "owner", None)
    one = plan.pass_seconds(1, length.row_cost)
    if isinstance(owner, Model) and one > 0.0:
        length.draft_cost = figures.cpu_seconds((("", owner.loader.model_bytes),)) / one


def draft_within_budget(
    draft_model: Any, ram_budget: int | str, n_ctx: int | None, kv_type: str | None, threads
) -> tuple[Model, int, int]:
    """Under a RAM budget the draft model stays resident beside the target (its file's
    pages and its KV cache), so it is loaded first and the target plans for what is left.
    Returns the loaded draft, the target's budget and the draft's bytes."""
    total = parse_budget(ram_budget)
    draft = _draft_model(draft_model, n_ctx, threads, kv_type_for(kv_type, ram_budget))
    need = draft.memory_bytes()
    left = total - need
    mib = 1 << 20
    if left <= 0:
        raise BudgetError(
            f"the draft model {draft.path.name} keeps {need / mib:.0f} MiB resident, more "
            f"than the RAM budget of {total / mib:.0f} MiB; use ngram drafts or no draft"
        )
    return draft, left, need


def minimum_ram_budget(
    model: str | os.PathLike | None = None,
    n_ctx: int | None = None,
    mode: str | None = None,
    kv_type: str = "f16",
) -> int:
    """The smallest ram_budget `load` accepts for this model and offload mode (with the
    f16 KV cache a budgeted load takes unless told otherwise)."""
    m = Model(resolve_model(model), n_ctx=n_ctx, kv_type=kv_type, interleave=False)
    return m.loader.minimum_ram_budget(mode)
