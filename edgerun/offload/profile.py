"""Neuron activation profiles: how often each FFN neuron is active (PowerInfer's hot/cold).

A neuron i of layer L is active for a token when |act(gate_i . x)| >= t_L, the CATS rule
of the offloading work (offload/sparsity.py), with t_L the layer's threshold from the
offload calibration (offload/store.py `prepare`) at a target sparsity. `profile_model`
runs the resident model over text in prefill chunks with each FFN wrapped by a counting
executor (one gate/up pass, the dense result unchanged) and keeps, per layer and neuron,
the number of active tokens and the activation mass (sum of |act(gate x)|): two
[n_layers, d_ff] arrays, never the per-token scores.

If a few neurons carry most of the activation (a power law), pinning them in RAM saves
most of the flash reads; `NeuronProfile.coverage` says how much the hottest share of
neurons covers, by count and by mass. The profile is kept beside the model's bundle and
calibration (`default_profile_path`) and read back by `load_default_profile`.
"""

from __future__ import annotations

import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgerun.errors import EdgerunError, InvalidArgumentError, ModelFormatError

__all__ = [
    "FORMAT_VERSION",
    "NeuronProfile",
    "CountingFFN",
    "default_profile_path",
    "load_default_profile",
    "load_profile",
    "profile_model",
    "profile_text",
    "read_text",
]

FORMAT_VERSION = 1
SUFFIX = ".profile.npz"
TOP_FRACTIONS = (0.1, 0.2, 0.5)
MAX_LAYERS = 4096  # bounds on a profile file's shapes, checked before reading its arrays
MAX_D_FF = 1 << 20


@dataclass
class NeuronProfile:
    """Per layer and neuron: active-token counts and activation mass over n_tokens."""

    counts: np.ndarray  # int64 [n_layers, d_ff]: tokens with |act(g_i)| >= t_L
    mass: np.ndarray  # float64 [n_layers, d_ff]: sum over tokens of |act(g_i)|
    n_tokens: int
    sparsity: float  # the calibration target the thresholds were taken at
    thresholds: np.ndarray  # float32 [n_layers]: t_L
    source_sha256: str  # the model file's SHA256, as its offload bundle records it
    model: str  # the model's name

    @property
    def n_layers(self) -> int:
        return int(self.counts.shape[0])

    @property
    def d_ff(self) -> int:
        return int(self.counts.shape[1])

    def _layer(self, layer: int) -> int:
        if not 0 <= layer < self.n_layers:
            raise InvalidArgumentError(f"layer {layer} out of range [0, {self.n_layers})")
        return layer

    def frequencies(self, layer: int) -> np.ndarray:
        """float64 [d_ff] in [0, 1]: the share of tokens each neuron was active for."""
        c = self.counts[self._layer(layer)]
        return c / self.n_tokens if self.n_tokens else np.zeros(c.shape, np.float64)

    def hot_order(self, layer: int) -> np.ndarray:
        """int64 [d_ff]: neuron ids, most often active first (ties: larger mass, then
        lower id)."""
        i = self._layer(layer)
        return np.lexsort((-self.mass[i], -self.counts[i])).astype(np.int64)

    def coverage(self, top_fraction: float, by: str = "count") -> tuple[np.ndarray, float]:
        """The share of all activation that each layer's top `top_fraction` of neurons
        (ceil(top_fraction * d_ff), ranked by the same measure) covers.

        by="count": active (token, neuron) pairs; by="mass": sum of |act(gate x)|.
        Returns (float64 [n_layers], overall): overall pools the layers, each keeping its
        own hottest neurons (what a per-layer pinned set would hold). A layer with no
        activation at all covers 0.
        """
        if not 0.0 <= top_fraction <= 1.0:
            raise InvalidArgumentError(f"top_fraction must be in [0, 1], got {top_fraction}")
        if by == "count":
            v = self.counts.astype(np.float64)
        elif by == "mass":
            v = self.mass.astype(np.float64)
        else:
            raise InvalidArgumentError(f"coverage by must be 'count' or 'mass', got {by!r}")
        k = int(np.ceil(top_fraction * self.d_ff - 1e-9))
        top = -np.sort(-v, axis=1)[:, :k].sum(axis=1)
        total = v.sum(axis=1)
        per = np.divide(top, total, out=np.zeros_like(top), where=total > 0)
        overall = float(top.sum() / total.sum()) if total.sum() > 0 else 0.0
        return per, overall

    def active_fraction(self) -> np.ndarray:
        """float64 [n_layers]: the mean share of a layer's neurons active per token."""
        if not self.n_tokens:
            return np.zeros(self.n_layers)
        return self.counts.sum(axis=1) / (self.n_tokens * self.d_ff)

    def describe(self) -> str:
        """A compact table: per layer and overall, the share the top 10/20/50% of neurons
        cover by count and by mass."""
        cols = [(f, by) for by in ("count", "mass") for f in TOP_FRACTIONS]
        cov = [self.coverage(f, by) for f, by in cols]
        act = self.active_fraction()
        heads = " ".join(f"{f'top{int(f * 100)}%':>6}" for f in TOP_FRACTIONS)
        lines = [
            f"{self.model}: {self.n_tokens} tokens, sparsity {self.sparsity:g}, "
            f"{self.n_layers} layers x {self.d_ff} neurons, "
            f"mean active {100 * act.mean():.1f}%",
            "share of activation covered by each layer's hottest neurons (by count the top "
            "X% covers between X% and X% / active)",
            f"{'':>7} {'':>9} {'':>7}  {'by count':^20}  {'by mass':^20}",
            f"{'layer':>7} {'t_L':>9} {'active':>7}  {heads}  {heads}",
        ]

        def row(label: str, t: str, a: float, vals: list[float]) -> str:
            c = " ".join(f"{100 * v:5.1f}%" for v in vals[:3])
            m = " ".join(f"{100 * v:5.1f}%" for v in vals[3:])
            return f"{label:>7} {t:>9} {100 * a:6.1f}%  {c}  {m}"

        for i in range(self.n_layers):
            lines.append(row(str(i), f"{self.thresholds[i]:.4g}", act[i], [p[i] for p, _ in cov]))
        lines.append(row("all", "", float(act.mean()), [o for _, o in cov]))
        lo = [float(p.min()) if p.size else 0.0 for p, _ in cov]
        hi = [float(p.max()) if p.size else 0.0 for p, _ in cov]
        lines.append(row("min", "", float(act.min()) if act.size else 0.0, lo))
        lines.append(row("max", "", float(act.max()) if act.size else 0.0, hi))
        return "\n".join(lines)

    # -- files ---------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write the profile as .npz, atomically (temp file, fsync, rename)."""
        from edgerun.runtime.atomic import write_atomic

        arrays = {
            "version": np.array(FORMAT_VERSION, np.int64),
            "counts": np.ascontiguousarray(self.counts, np.int64),
            "mass": np.ascontiguousarray(self.mass, np.float64),
            "n_tokens": np.array(self.n_tokens, np.int64),
            "sparsity": np.array(self.sparsity, np.float64),
            "thresholds": np.ascontiguousarray(self.thresholds, np.float32),
            "source_sha256": np.array(self.source_sha256),
            "model": np.array(self.model),
        }

        def write(tmp: Path) -> None:
            with open(tmp, "wb") as f:
                np.savez(f, **arrays)

        return write_atomic(path, write)

    @classmethod
    def load(cls, path: str | Path, expect_sha256: str | None = None) -> NeuronProfile:
        """Read and validate a profile; ModelFormatError names the file and the field.

        Shapes and dtypes are checked from the array headers before any array is read,
        so a hostile file cannot make it allocate more than the bounds allow."""
        path = Path(path)

        def bad(field: str, why: str) -> ModelFormatError:
            return ModelFormatError(
                f"{path}: neuron profile field '{field}' {why}; "
                "remake it with `edgerun profile MODEL`"
            )

        try:
            zf = zipfile.ZipFile(path)
        except FileNotFoundError:
            raise ModelFormatError(f"{path}: no such neuron profile file") from None
        except (OSError, zipfile.BadZipFile, ValueError) as e:
            raise ModelFormatError(f"{path}: not a neuron profile (.npz): {e}") from None
        with zf:
            names = set(zf.namelist())

            def read(field: str, kinds: str, ndim: int) -> np.ndarray:
                if f"{field}.npy" not in names:
                    raise bad(field, "is missing")
                try:
                    with zf.open(f"{field}.npy") as f:
                        ver = np.lib.format.read_magic(f)
                        if ver == (1, 0):
                            shape, _, dtype = np.lib.format.read_array_header_1_0(f)
                        elif ver == (2, 0):
                            shape, _, dtype = np.lib.format.read_array_header_2_0(f)
                        else:
                            raise ValueError(f"unsupported .npy version {ver}")
                        if dtype.kind not in kinds or dtype.hasobject:
                            raise bad(field, f"has dtype {dtype}, expected kind {kinds!r}")
                        if len(shape) != ndim:
                            raise bad(field, f"has shape {shape}, expected {ndim} dimensions")
                        if ndim == 2 and (shape[0] > MAX_LAYERS or shape[1] > MAX_D_FF):
                            raise bad(field, f"has shape {shape}, beyond the bounds")
                        if ndim == 1 and shape[0] > MAX_LAYERS:
                            raise bad(field, f"has shape {shape}, beyond the bounds")
                        if dtype.kind == "U" and dtype.itemsize > 4 * 1024:
                            raise bad(field, "is too long")
                    with zf.open(f"{field}.npy") as f:
                        return np.lib.format.read_array(f, allow_pickle=False)
                except ModelFormatError:
                    raise
                except (OSError, ValueError, EOFError, zipfile.BadZipFile, RuntimeError) as e:
                    raise bad(field, f"cannot be read ({e})") from None

            version = read("version", "iu", 0)
            if int(version) != FORMAT_VERSION:
                raise bad("version", f"is {int(version)}, expected {FORMAT_VERSION}")
            counts = read("counts", "i", 2)
            if counts.dtype != np.int64:
                raise bad("counts", f"has dtype {counts.dtype}, expected int64")
            n_layers, d_ff = counts.shape
            if n_layers < 1 or d_ff < 1:
                raise bad("counts", f"has shape {counts.shape}, expected [n_layers, d_ff] >= 1")
            mass = read("mass", "f", 2)
            if mass.dtype != np.float64:
                raise bad("mass", f"has dtype {mass.dtype}, expected float64")
            if mass.shape != counts.shape:
                raise bad("mass", f"has shape {mass.shape}, expected {counts.shape} as counts")
            if not np.isfinite(mass).all() or (mass < 0).any():
                raise bad("mass", "holds negative or non-finite values")
            n_tokens = int(read("n_tokens", "iu", 0))
            if n_tokens < 0:
                raise bad("n_tokens", f"is {n_tokens}, expected >= 0")
            if (counts < 0).any() or (counts > n_tokens).any():
                raise bad("counts", f"holds values outside [0, n_tokens={n_tokens}]")
            sparsity = float(read("sparsity", "f", 0))
            if not (np.isfinite(sparsity) and 0.0 <= sparsity < 1.0):
                raise bad("sparsity", f"is {sparsity}, expected in [0, 1)")
            thresholds = read("thresholds", "f", 1)
            if thresholds.dtype != np.float32:
                raise bad("thresholds", f"has dtype {thresholds.dtype}, expected float32")
            if thresholds.shape != (n_layers,):
                raise bad("thresholds", f"has shape {thresholds.shape}, expected ({n_layers},)")
            if not np.isfinite(thresholds).all() or (thresholds < 0).any():
                raise bad("thresholds", "holds negative or non-finite values")
            sha = str(read("source_sha256", "U", 0))
            if len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
                raise bad("source_sha256", f"is {sha[:80]!r}, expected 64 hex digits")
            if expect_sha256 is not None and sha != expect_sha256.lower():
                raise bad(
                    "source_sha256",
                    f"is {sha[:16]}..., but the model file's is {expect_sha256[:16]}... "
                    "(a profile of another file)",
                )
            model = str(read("model", "U", 0))
        return cls(counts, mass, n_tokens, sparsity, thresholds, sha, model)


# ------------------------------------------------------------------------- counting
class CountingFFN:
    """Wraps a layer's dense executor: adds each neuron's active tokens (|act(g)| >= t)
    and |act(g)| mass to the profile arrays, returns the dense result unchanged (same
    kernels, same numbers, gate and up computed once)."""

    def __init__(self, inner, counts: np.ndarray, mass: np.ndarray, threshold: float) -> None:
        self.inner, self.counts, self.mass = inner, counts, mass
        self.threshold = np.float32(threshold)
        self.d_model, self.d_ff = inner.d_model, inner.d_ff

    def __call__(self, x: np.ndarray) -> np.ndarray:
        from edgerun.offload.sparsity import abs_act
        from edgerun.ops import qmatvec
        from edgerun.ops.activations import glu

        d = self.inner
        g, u = qmatvec.project_many((d.gate, d.up), x)
        s = abs_act(g, d.activation)
        self.counts += (s >= self.threshold).sum(axis=0, dtype=np.int64)
        self.mass += s.sum(axis=0, dtype=np.float64)
        return qmatvec.project(d.down, glu(g, u, d.activation))


def _model_sha(model_path) -> str | None:
    """The registry's verified SHA256 of the model file, if it is a registry model."""
    from edgerun import registry

    m = registry.find_by_file(model_path)
    return getattr(m, "sha256", None)


def _check_gguf(model_path) -> Path:
    p = Path(model_path)
    if not p.is_file():
        raise InvalidArgumentError(
            f"{p}: neuron profiles are kept beside the offload bundle of a .gguf file; "
            "profile the .gguf model instead of a pack"
        )
    return p


def profile_model(
    model_path,
    file,
    transformer,
    tokenizer,
    tokens: Sequence[int],
    sparsity: float | None = None,
    chunk: int = 128,
    progress: bool = True,
    kv_type: str = "f32",
) -> NeuronProfile:
    """Count each FFN neuron's active tokens over `tokens` on a resident Transformer of
    the GGUF at `model_path` (opened as `file`; `tokenizer` encodes the calibration).

    Thresholds: the offload calibration's (made and cached by store.prepare when missing)
    at `sparsity` (default: store.DEFAULT_SPARSITY). The tokens run in prefill chunks of
    `chunk`, each from an empty KV cache of `kv_type`, as the calibration runs them. The
    Transformer's executors are restored afterwards."""
    from edgerun.offload.bundle import source_sha256
    from edgerun.offload.sparsity import _dense
    from edgerun.offload.store import DEFAULT_SPARSITY, prepare
    from edgerun.runtime.progress import progress_bar

    sparsity = DEFAULT_SPARSITY if sparsity is None else float(sparsity)
    if not (np.isfinite(sparsity) and 0.0 <= sparsity < 1.0):
        raise InvalidArgumentError(f"sparsity must be in [0, 1), got {sparsity}")
    if chunk < 1:
        raise InvalidArgumentError(f"chunk must be >= 1 token, got {chunk}")
    toks = [int(t) for t in tokens]
    if not toks:
        raise InvalidArgumentError("profiling needs at least one token")
    from edgerun.generate.engine import check_token_ids

    spec = transformer.spec
    check_token_ids(toks, spec.vocab_size)
    path = _check_gguf(model_path)
    sha = _model_sha(path)
    _, cal = prepare(path, file, transformer, tokenizer, sha256=sha, progress=progress)
    sha = sha or source_sha256(path)
    thresholds = cal.thresholds(sparsity)
    tr = transformer
    n = len(tr.layers)
    d_ff = spec.d_ff
    if thresholds.shape != (n,):
        raise ModelFormatError(
            f"{path}: offload calibration has {thresholds.shape[0]} layers, the model {n}"
        )
    counts = np.zeros((n, d_ff), np.int64)
    mass = np.zeros((n, d_ff), np.float64)
    saved = [layer.ffn for layer in tr.layers]
    try:
        for i, layer in enumerate(tr.layers):
            layer.ffn = CountingFFN(_dense(layer.ffn), counts[i], mass[i], float(thresholds[i]))
        with progress_bar("profiling", total=len(toks), unit="tokens", enabled=progress) as adv:
            for c in range(0, len(toks), chunk):
                part = toks[c : c + chunk]
                tr.forward(part, tr.new_cache(len(part), kv_type))
                adv(len(part))
    finally:
        for layer, ffn in zip(tr.layers, saved, strict=True):
            layer.ffn = ffn
    return NeuronProfile(
        counts, mass, len(toks), sparsity, thresholds.astype(np.float32), sha, spec.name
    )


# ----------------------------------------------------------------------------- files
def default_profile_path(model_path, sparsity: float | None = None) -> Path:
    """Beside the model's bundle and calibration (store.prepare), so a new version of the
    file gets a new profile: <cache>/offload/<bundle name>.profile.npz at the runtime's
    default sparsity, <bundle name>.profile-s<sparsity>.npz at another."""
    from edgerun.offload.bundle import bundle_path, source_sha256

    p = _check_gguf(model_path)
    sha = _model_sha(p) or source_sha256(p)
    return bundle_path(p, sha).with_suffix(_suffix(sparsity))


def _suffix(sparsity: float | None) -> str:
    from edgerun.offload.store import DEFAULT_SPARSITY

    s = DEFAULT_SPARSITY if sparsity is None else round(float(sparsity), 4)
    return SUFFIX if s == DEFAULT_SPARSITY else f".profile-s{s:g}.npz"


def load_default_profile(model_path, spec, sparsity: float | None = None) -> NeuronProfile | None:
    """The saved profile of the model file at `model_path` (its `spec`) at `sparsity`
    (default: the runtime's), or None when there is none. A profile that does not
    validate, was made from another file or for another shape raises ModelFormatError
    saying how to remake it."""
    from edgerun.offload.bundle import source_sha256
    from edgerun.offload.store import DEFAULT_SPARSITY

    path = default_profile_path(model_path, sparsity)
    if not path.exists():
        return None
    sha = _model_sha(model_path) or source_sha256(model_path)
    prof = NeuronProfile.load(path, expect_sha256=sha)
    want = (spec.n_layers, spec.d_ff)
    if prof.counts.shape != want:
        raise ModelFormatError(
            f"{path}: neuron profile field 'counts' has shape {prof.counts.shape}, the model "
            f"has {want[0]} layers x {want[1]} neurons; remake it with `edgerun profile MODEL`"
        )
    s = DEFAULT_SPARSITY if sparsity is None else float(sparsity)
    if abs(prof.sparsity - s) > 1e-4:
        raise ModelFormatError(
            f"{path}: neuron profile field 'sparsity' is {prof.sparsity:g}, expected {s:g}; "
            "remake it with `edgerun profile MODEL`"
        )
    return prof


def load_profile(model_path, spec, path: str | Path | None = None) -> NeuronProfile | None:
    """The profile at `path` checked against the model file at `model_path`, else its
    default one (None when there is none)."""
    if path is None:
        return load_default_profile(model_path, spec)
    from edgerun.offload.bundle import source_sha256

    sha = _model_sha(model_path) or source_sha256(model_path)
    return NeuronProfile.load(path, expect_sha256=sha)


def read_text(path: str | Path | None) -> str:
    """The text of a file (UTF-8), or the built-in calibration text (edgerun.corpus) for
    None. A missing, unreadable or empty file is an EdgerunError naming it."""
    if path is None:
        from edgerun.corpus import calibration_text

        return calibration_text()
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise EdgerunError(f"cannot read {path}: not UTF-8 text ({e.reason})") from None
    except OSError as e:
        raise EdgerunError(f"cannot read {path}: {e.strerror or e}") from None
    if not text.strip():
        raise EdgerunError(f"{path} is empty: give a text file to profile on")
    return text


def profile_text(
    model_path,
    file,
    transformer,
    tokenizer,
    text_path: str | Path | None = None,
    n_tokens: int = 512,
    sparsity: float | None = None,
    out: str | Path | None = None,
    progress: bool = True,
    kv_type: str = "f32",
) -> tuple[NeuronProfile, Path]:
    """Profile the resident Transformer of the GGUF at `model_path` (profile_model) on
    the first `n_tokens` tokens of a text file (default: the built-in calibration text)
    and save it at `out` (default: `default_profile_path` at that sparsity)."""
    if n_tokens < 1:
        raise InvalidArgumentError(f"--tokens must be >= 1, got {n_tokens}")
    text = read_text(text_path)
    ids = tokenizer.encode(text)[:n_tokens]
    prof = profile_model(
        model_path, file, transformer, tokenizer, ids, sparsity, progress=progress, kv_type=kv_type
    )
    path = Path(out) if out is not None else default_profile_path(model_path, sparsity)
    return prof, prof.save(path)
