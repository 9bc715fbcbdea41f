"""Which FFN neurons a token needs, known before their up/down parts are read.

SwiGLU / GeGLU FFNs are not ReLU-sparse, but |act(gate . x)| is small for most neurons
of most tokens. CATS (Lee et al., arXiv 2404.08763): skip neuron i when
|act(g_i)| < t_L, with a per-layer threshold t_L calibrated on text to a target
sparsity (the quantile of |act(g)| over calibration tokens); training-free.

- (a) gate-resident: the gate matrix stays in RAM, g = gate x is exact, and only the
  up rows / down columns of the active neurons are read (`ThresholdedFFN` computes
  exactly this on resident weights, through the sparse kernels, to measure quality).
- (b) `LowRankPredictor`: gate rows live on flash too; a rank-r factor of the gate,
  optionally whitened by the calibration inputs' covariance (the best rank-r map for
  those inputs), predicts g; neurons whose predicted |act| clears a lowered per-layer
  threshold are read (gate row included) and then thresholded exactly.

Calibration runs the real model with each layer's FFN wrapped by `RecordingFFN`, so
model.py is untouched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from edgerun.errors import InvalidArgumentError
from edgerun.model.ffn import DenseFFN
from edgerun.ops import qmatvec
from edgerun.ops import sparse_ffn as sf
from edgerun.ops.activations import glu
from edgerun.quant.formats import QuantTensor, QuantType
from edgerun.quant.quantize import quantize
from edgerun.quant.reference import dequantize

__all__ = [
    "ActivationRecords",
    "LowRankPredictor",
    "RecordingFFN",
    "SparseQuality",
    "ThresholdedFFN",
    "SPARSITY_GRID",
    "abs_act",
    "allocate_sparsity",
    "layer_error_curves",
    "neuron_weights",
    "calibrate_thresholds",
    "collect_activations",
    "down_rows_q8_0",
    "fit_predictors",
    "predictor_recall",
    "sparse_quality",
]


def abs_act(g: np.ndarray, activation: str) -> np.ndarray:
    """|act(g)| (glu with u = 1), the CATS score."""
    return np.abs(glu(np.ascontiguousarray(g, np.float32), np.ones_like(g), activation))


# ----------------------------------------------------------------------- calibration
@dataclass
class ActivationRecords:
    """Per layer: FFN inputs x [T, d_model] and scores |act(gate x)| [T, d_ff] (float16)."""

    x: list[list[np.ndarray]] = field(default_factory=list)
    score: list[list[np.ndarray]] = field(default_factory=list)

    def layer_x(self, layer: int) -> np.ndarray:
        return np.concatenate(self.x[layer], axis=0)

    def layer_score(self, layer: int) -> np.ndarray:
        return np.concatenate(self.score[layer], axis=0)


class RecordingFFN:
    """Wraps a layer's dense executor; records its inputs and |act(gate x)|, returns the
    dense result unchanged."""

    def __init__(self, inner: DenseFFN, records: ActivationRecords, layer: int, keep_x: bool):
        self.inner, self.records, self.layer, self.keep_x = inner, records, layer, keep_x
        self.d_model, self.d_ff = inner.d_model, inner.d_ff

    def __call__(self, x: np.ndarray) -> np.ndarray:
        g = qmatvec.project(self.inner.gate, x)
        self.records.score[self.layer].append(abs_act(g, self.inner.activation).astype(np.float16))
        if self.keep_x:
            self.records.x[self.layer].append(np.array(x, np.float32))
        return self.inner(x)


def _dense(ffn) -> DenseFFN:
    inner = getattr(ffn, "inner", ffn)
    if not isinstance(inner, DenseFFN):
        raise InvalidArgumentError(f"calibration needs resident dense FFNs, got {type(inner)}")
    return inner


def forward_logits(
    transformer, ids: Sequence[int], kv_type: str = "f32", step: int | None = None
) -> np.ndarray:
    """float32 [len(ids), vocab]: a Transformer's next-token logits after each prefix of
    `ids`, from an empty KV cache of `kv_type`, in forward calls of at most `step` tokens
    (default: the engine's prompt chunk)."""
    from edgerun.generate.engine import PREFILL_CHUNK, check_token_ids

    ids = [int(i) for i in ids]
    if not ids:
        raise InvalidArgumentError("logits need at least one token id")
    check_token_ids(ids, transformer.spec.vocab_size)
    step = step or PREFILL_CHUNK
    cache = transformer.new_cache(len(ids), kv_type)
    parts = [
        transformer.forward(ids[i : i + step], cache, all_logits=True)
        for i in range(0, len(ids), step)
    ]
    return np.concatenate(parts, axis=0)


def collect_activations(
    transformer,
    tokens: Sequence[int],
    layers: Sequence[int] | None = None,
    keep_x: bool = True,
    chunk: int = 256,
    kv_type: str = "f32",
    step: int | None = None,
) -> ActivationRecords:
    """Run a resident Transformer over `tokens` in chunks of `chunk` (each from an empty
    KV cache of `kv_type`, forward calls of at most `step` tokens) and record every
    FFN's inputs and gate scores.

    Layers not in `layers` get empty records. The executors are restored afterwards.
    """
    tr = transformer
    n = len(tr.layers)
    want = set(range(n) if layers is None else layers)
    rec = ActivationRecords([[] for _ in range(n)], [[] for _ in range(n)])
    saved = [layer.ffn for layer in tr.layers]
    try:
        for i, layer in enumerate(tr.layers):
            if i in want:
                layer.ffn = RecordingFFN(_dense(layer.ffn), rec, i, keep_x)
        toks = [int(t) for t in tokens]
        for c in range(0, len(toks), chunk):
            forward_logits(tr, toks[c : c + chunk], kv_type, step)
    finally:
        for layer, ffn in zip(tr.layers, saved, strict=True):
            layer.ffn = ffn
    return rec


def calibrate_thresholds(
    records: ActivationRecords | Sequence[np.ndarray],
    target_sparsity: float | np.ndarray,
    weights: Sequence[np.ndarray] | None = None,
) -> np.ndarray:
    """Per-layer t_L: the target-sparsity quantile of |act(g)| over calibration tokens,
    so that fraction of neurons falls below it and is skipped. float32 [n_layers];
    layers without records get 0 (dense). target_sparsity: one value, or one per layer
    (e.g. from `allocate_sparsity`). weights: per-layer neuron weights (see
    `neuron_weights`); the score is then |act(g_i)| * w_i."""
    scores = (
        [records.layer_score(i) if records.score[i] else None for i in range(len(records.score))]
        if isinstance(records, ActivationRecords)
        else list(records)
    )
    target = np.broadcast_to(np.asarray(target_sparsity, np.float64), (len(scores),))
    if ((target < 0) | (target >= 1)).any():
        raise InvalidArgumentError(f"target sparsity must be in [0, 1), got {target_sparsity}")
    out = np.zeros(len(scores), np.float32)
    for i, s in enumerate(scores):
        if s is not None and s.size and target[i] > 0:
            sc = s.astype(np.float32) if weights is None else s.astype(np.float32) * weights[i]
            out[i] = np.quantile(sc.reshape(-1), target[i])
    return out


def neuron_weights(transformer, records: ActivationRecords) -> list[np.ndarray | None]:
    """w_i = mean |u_i| * ||down[:, i]|| per recorded layer (None elsewhere).

    |act(g_i)| alone ranks neurons badly when the up output or the down column is large:
    SiLU saturates at |act| ~0.28 for negative g, where most of SmolLM2's neurons sit.
    Scoring |act(g_i)| * w_i (a per-neuron threshold t / w_i, no runtime cost) cut the
    thresholded layer's error by 10-30% in SmolLM2's middle layers at equal sparsity.
    """
    out: list[np.ndarray | None] = []
    for i, layer in enumerate(transformer.layers):
        if not records.x[i]:
            out.append(None)
            continue
        dense = _dense(layer.ffn)
        u = qmatvec.project(dense.up, records.layer_x(i)[:256])
        down = dequantize(dense.down.qtype, np.asarray(dense.down.data)).reshape(dense.down.shape)
        out.append((np.abs(u).mean(axis=0) * np.linalg.norm(down, axis=0)).astype(np.float32))
    return out


SPARSITY_GRID = np.round(np.arange(0.0, 0.951, 0.05), 2)


def layer_error_curves(
    transformer,
    records: ActivationRecords,
    grid: np.ndarray = SPARSITY_GRID,
    max_tokens: int = 128,
    down_q8: list[np.ndarray] | None = None,
    weights: Sequence[np.ndarray | None] | None = None,
) -> np.ndarray:
    """float64 [n_layers, len(grid)]: mean relative error ||y_s - y_0|| / ||y_0|| of each
    layer's thresholded FFN at each sparsity of `grid` on calibration inputs.

    Layers differ a lot (SmolLM2: the first and last layers lose ~3% at 30% sparsity, the
    middle ones ~15-19%), so one sparsity for all layers wastes the easy ones."""
    tr = transformer
    out = np.zeros((len(tr.layers), len(grid)))
    for i, layer in enumerate(tr.layers):
        if not records.x[i]:
            continue
        dense = _dense(layer.ffn)
        x = records.layer_x(i)[:max_tokens]
        w = None if weights is None else weights[i]
        score = records.layer_score(i).astype(np.float32)
        score = (score if w is None else score * w).reshape(-1)
        base = ThresholdedFFN(dense, 0.0, None if down_q8 is None else down_q8[i], weight=w)
        y0 = base(x)
        n0 = np.linalg.norm(y0, axis=1) + 1e-12
        for j, s in enumerate(grid):
            if s > 0:
                base.threshold = np.float32(np.quantile(score, s))
                out[i, j] = float((np.linalg.norm(base(x) - y0, axis=1) / n0).mean())
    return out


def allocate_sparsity(
    errors: np.ndarray, target: float, grid: np.ndarray = SPARSITY_GRID
) -> np.ndarray:
    """Per-layer sparsities with mean `target` and the least total error: start dense,
    then repeatedly raise the layer whose next grid step adds the least error.

    Measured on SmolLM2 (512 tokens), with `layer_error_curves` (relative FFN output
    error) as the error: worse than one sparsity for all layers (target 0.2: 82% argmax
    agreement vs 92% uniform). It piles sparsity on the first and last layers, whose small
    relative error still moves the logits most; a better proxy (error relative to the
    residual stream, or end-to-end KL) is needed before this is worth using.
    """
    n, k = errors.shape
    pos = np.zeros(n, np.int64)
    need = target * n
    while grid[pos].sum() < need - 1e-9:
        cost = np.full(n, np.inf)
        ok = np.flatnonzero(pos + 1 < k)
        step = errors[ok, pos[ok] + 1] - errors[ok, pos[ok]]
        cost[ok] = step / (grid[pos[ok] + 1] - grid[pos[ok]])
        if not np.isfinite(cost).any():
            break
        pos[int(np.argmin(cost))] += 1
    return grid[pos].astype(np.float64)


# ------------------------------------------------------------- resident reference
def down_rows_q8_0(down: QuantTensor) -> np.ndarray:
    """down [d_model, d_ff] -> its columns as Q8_0 rows uint8 [d_ff, d_model/32*34], the
    flash format of the down part (one row per neuron)."""
    d_model, d_ff = down.shape
    w = dequantize(down.qtype, np.asarray(down.data)).reshape(d_model, d_ff)
    return quantize(np.ascontiguousarray(w.T, dtype=np.float32), QuantType.Q8_0)


class ThresholdedFFN:
    """CATS on resident weights: exact gate, neurons with |act(g)| < threshold skipped,
    up rows and Q8_0 down rows of the active ones through the sparse kernels.

    The reference executor for quality measurements (what the flash executor computes,
    without flash). Optionally `predictor` first narrows the candidates, as when the gate
    lives on flash: then only predicted neurons can be active.
    Statistics: `active` (neurons used) and `calls` (token rows) accumulate.
    """

    def __init__(
        self,
        dense: DenseFFN,
        threshold: float,
        down_q8: np.ndarray | None = None,
        predictor: LowRankPredictor | None = None,
        weight: np.ndarray | None = None,
    ) -> None:
        self.dense = dense
        self.threshold = np.float32(threshold)
        self.down = down_rows_q8_0(dense.down) if down_q8 is None else down_q8
        self.predictor = predictor
        self.weight = None if weight is None else np.asarray(weight, np.float32)
        self.d_model, self.d_ff = dense.d_model, dense.d_ff
        self.activation = dense.activation
        self.up = np.ascontiguousarray(np.asarray(dense.up.data).view(np.uint8)).reshape(
            self.d_ff, -1
        )
        self.active = 0
        self.predicted = 0
        self.calls = 0

    def _mask(self, x: np.ndarray, g: np.ndarray) -> np.ndarray:
        score = abs_act(g, self.activation)
        if self.weight is not None:
            score *= self.weight
        mask = score >= self.threshold
        if self.predictor is not None:
            pred = self.predictor.predict(x)
            self.predicted += int(pred.sum())
            mask &= pred
        return mask

    def __call__(self, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, np.float32)
        n = x.shape[0]
        out = np.zeros((n, self.d_model), np.float32)
        g = qmatvec.project(self.dense.gate, x)
        mask = self._mask(x, g)
        self.calls += n
        self.active += int(mask.sum())
        if n == 1:
            idx = np.flatnonzero(mask[0]).astype(np.int32)
            u = sf.matvec_rows(self.dense.up.qtype, self.d_model, self.up, idx, x[0])
            h = glu(np.ascontiguousarray(g[0, idx])[None], u[None], self.activation)[0]
            sf.accumulate_q8_0_rows(self.down, h, out[0], idx)
            return out
        union = np.flatnonzero(mask.any(axis=0)).astype(np.int32)
        u = qmatvec.project(self.dense.up, x)  # prefill: dense up, same numbers per row
        h = glu(g, u, self.activation)
        h[~mask] = 0.0
        sf.accumulate_q8_0_rows_many(self.down, np.ascontiguousarray(h[:, union]), out, union)
        return out


# ------------------------------------------------------------------------ predictor
@dataclass
class LowRankPredictor:
    """g_hat = a @ (b @ x): rank-r approximation of one layer's gate.

    active_hat = |act(g_hat)| >= threshold, the threshold set (by `fit_predictors`) low
    enough to reach a recall target on calibration tokens. Costs r * (d_model + d_ff)
    float16 values per layer instead of the gate's d_ff * d_model quantized weights.
    """

    a: np.ndarray  # float32 [d_ff, r]
    b: np.ndarray  # float32 [r, d_model]
    activation: str
    threshold: float = 0.0

    @property
    def rank(self) -> int:
        return int(self.b.shape[0])

    @property
    def nbytes_f16(self) -> int:
        return 2 * (self.a.size + self.b.size)

    def scores(self, x: np.ndarray) -> np.ndarray:
        """|act(g_hat)| float32 [n, d_ff] for x [n, d_model]."""
        g = (np.asarray(x, np.float32) @ self.b.T) @ self.a.T
        return abs_act(g, self.activation)

    def predict(self, x: np.ndarray) -> np.ndarray:
        """bool [n, d_ff]: neurons predicted active."""
        return self.scores(x) >= np.float32(self.threshold)

    @classmethod
    def from_gate(
        cls,
        gate: np.ndarray,
        rank: int,
        activation: str,
        x_calib: np.ndarray | None = None,
        shrink: float = 0.5,
    ) -> LowRankPredictor:
        """Truncated SVD of the dequantized gate [d_ff, d_model]; with calibration inputs,
        of gate @ C^(1/2) (C = E[x x^T]), the rank-r map with least error on such x."""
        gate = np.asarray(gate, np.float64)
        rank = min(rank, *gate.shape)
        if x_calib is None:
            u, s, vt = np.linalg.svd(gate, full_matrices=False)
            a = u[:, :rank] * s[:rank]
            b = vt[:rank]
        else:
            xc = np.asarray(x_calib, np.float64)
            c = xc.T @ xc / max(1, xc.shape[0])
            # shrink toward a scaled identity: with fewer tokens than dimensions the raw
            # covariance is singular and the fit would overfit the calibration tokens
            c += shrink * np.trace(c) / c.shape[0] * np.eye(c.shape[0])
            w, v = np.linalg.eigh(c)
            w = np.maximum(w, w.max() * 1e-9)
            half = (v * np.sqrt(w)) @ v.T
            ihalf = (v / np.sqrt(w)) @ v.T
            u, s, vt = np.linalg.svd(gate @ half, full_matrices=False)
            a = u[:, :rank] * s[:rank]
            b = vt[:rank] @ ihalf
        return cls(a.astype(np.float32), b.astype(np.float32), activation)


def _gate_float(gate: QuantTensor) -> np.ndarray:
    return dequantize(gate.qtype, np.asarray(gate.data)).reshape(gate.shape)


def fit_predictors(
    transformer,
    records: ActivationRecords,
    thresholds: np.ndarray,
    rank: int = 128,
    recall: float = 0.95,
    layers: Sequence[int] | None = None,
    whiten: bool = False,
) -> dict[int, LowRankPredictor]:
    """One LowRankPredictor per recorded layer, its threshold lowered until it catches
    `recall` of the calibration tokens' truly active (score >= t_L) neurons.

    whiten=False (plain SVD of the gate) by default: on SmolLM2 with 192 calibration
    tokens its recall held out matched calibration (0.95 -> 0.95) while the whitened fit
    overfit (0.95 -> 0.53-0.83); whitening needs many more tokens than d_model.
    """
    tr = transformer
    want = [i for i in range(len(tr.layers)) if records.x[i]] if layers is None else layers
    out = {}
    for i in want:
        dense = _dense(tr.layers[i].ffn)
        x = records.layer_x(i)
        p = LowRankPredictor.from_gate(
            _gate_float(dense.gate), rank, dense.activation, x if whiten else None
        )
        truth = records.layer_score(i).astype(np.float32) >= thresholds[i]
        ps = p.scores(x)[truth]
        p.threshold = float(np.quantile(ps, 1.0 - recall)) if ps.size else 0.0
        out[i] = p
    return out


def predictor_recall(
    p: LowRankPredictor, x: np.ndarray, score: np.ndarray, threshold: float
) -> tuple[float, float, float]:
    """(recall of truly active neurons, predicted fraction, truly active fraction) on x."""
    truth = np.asarray(score, np.float32) >= np.float32(threshold)
    pred = p.predict(x)
    tp = int((truth & pred).sum())
    return tp / max(1, int(truth.sum())), float(pred.mean()), float(truth.mean())


# --------------------------------------------------------------------------- quality
@dataclass
class SparseQuality:
    sparsity_target: float
    agreement: float  # teacher-forced argmax agreement with the dense model
    ppl_dense: float
    ppl: float
    active_fraction: float  # neurons actually used / d_ff, over all layers and tokens


def _nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    lg = logits.astype(np.float64)
    m = lg.max(axis=1, keepdims=True)
    return m[:, 0] + np.log(np.exp(lg - m).sum(axis=1)) - lg[np.arange(len(targets)), targets]


def sparse_quality(
    transformer,
    chunks: Sequence[Sequence[int]],
    thresholds: np.ndarray,
    target: float,
    dense_logits: list[np.ndarray] | None = None,
    predictors: dict[int, LowRankPredictor] | None = None,
    down_q8: list[np.ndarray] | None = None,
    weights: Sequence[np.ndarray | None] | None = None,
    kv_type: str = "f32",
) -> tuple[SparseQuality, list[np.ndarray]]:
    """Teacher-forced comparison of ThresholdedFFN layers against the dense model on
    token chunks (each from an empty cache). Returns the figures and the dense logits
    (pass them back in to score further thresholds without recomputing them)."""
    tr = transformer
    if dense_logits is None:
        dense_logits = [forward_logits(tr, c, kv_type) for c in chunks]
    saved = [layer.ffn for layer in tr.layers]
    execs = []
    try:
        for i, layer in enumerate(tr.layers):
            dq = None if down_q8 is None else down_q8[i]
            p = None if predictors is None else predictors.get(i)
            w = None if weights is None else weights[i]
            layer.ffn = ThresholdedFFN(_dense(layer.ffn), float(thresholds[i]), dq, p, w)
            execs.append(layer.ffn)
        agree, total, nll_d, nll_s = 0, 0, [], []
        for c, dl in zip(chunks, dense_logits, strict=True):
            sl = forward_logits(tr, c, kv_type)
            agree += int((sl.argmax(1) == dl.argmax(1)).sum())
            total += len(c)
            tgt = np.asarray(c[1:])
            nll_d.append(_nll(dl[:-1], tgt))
            nll_s.append(_nll(sl[:-1], tgt))
    finally:
        for layer, ffn in zip(tr.layers, saved, strict=True):
            layer.ffn = ffn
    act = sum(e.active for e in execs) / max(1, sum(e.calls * e.d_ff for e in execs))
    q = SparseQuality(
        target,
        agree / max(1, total),
        float(np.exp(np.concatenate(nll_d).mean())),
        float(np.exp(np.concatenate(nll_s).mean())),
        act,
    )
    return q, dense_logits
