"""CATS thresholds, the thresholded reference executor and the low-rank predictor on the
real SmolLM2 (a few layers, small calibration sets, so this stays well under a minute)."""

import numpy as np
import pytest

from edgerun.corpus import calibration_text, evaluation_text
from edgerun.offload import sparsity as sp

LAYERS = (0, 13, 29)


@pytest.fixture(scope="module")
def recorded(smollm2):
    enc = smollm2.tokenizer.encode
    cal = enc(calibration_text(), add_bos=False, parse_special=False)[:192]
    held = enc(evaluation_text(), add_bos=False, parse_special=False)[:128]
    return (
        sp.collect_activations(smollm2.transformer, cal, layers=LAYERS),
        sp.collect_activations(smollm2.transformer, held, layers=LAYERS),
    )


def test_thresholds_hit_the_target_sparsity(recorded):
    rec, held = recorded
    th = sp.calibrate_thresholds(rec, 0.7)
    assert th.shape == (30,) and (th[list(LAYERS)] > 0).all() and th[1] == 0
    for i in LAYERS:
        assert (rec.layer_score(i) < th[i]).mean() == pytest.approx(0.7, abs=0.01)
        # held-out tokens: the threshold generalizes roughly
        assert (held.layer_score(i) < th[i]).mean() == pytest.approx(0.7, abs=0.12)
    assert (sp.calibrate_thresholds(rec, 0.0) == 0).all()


def test_recording_leaves_the_model_unchanged(smollm2):
    ids = smollm2.tokenize("def add(a, b):\n    return")
    before = smollm2.logits(ids)
    sp.collect_activations(smollm2.transformer, ids, layers=(3,))
    assert type(smollm2.transformer.layers[3].ffn).__name__ == "DenseFFN"
    assert np.array_equal(smollm2.logits(ids), before)


def test_thresholded_ffn_decode_and_prefill_paths_agree(smollm2, recorded):
    rec, _ = recorded
    dense = smollm2.transformer.layers[13].ffn
    x = rec.layer_x(13)[:6]
    t = float(sp.calibrate_thresholds(rec, 0.5)[13])
    ffn = sp.ThresholdedFFN(dense, t)
    many = ffn(x)
    one = np.concatenate([ffn(x[i : i + 1]) for i in range(len(x))])
    scale = np.abs(many).max()
    assert np.allclose(many, one, atol=2e-3 * scale)
    assert 0.3 < ffn.active / (ffn.calls * ffn.d_ff) < 0.7
    # threshold 0: every neuron, only the Q8_0 down requantization differs from dense
    full = sp.ThresholdedFFN(dense, 0.0, ffn.down)(x)
    assert np.allclose(full, dense(x), atol=2e-2 * np.abs(full).max())


def test_low_rank_predictor_recall_on_held_out_tokens(smollm2, recorded):
    rec, held = recorded
    th = sp.calibrate_thresholds(rec, 0.7)
    preds = sp.fit_predictors(smollm2.transformer, rec, th, rank=128, recall=0.95, layers=LAYERS)
    for i in LAYERS:
        recall, predicted, truly = sp.predictor_recall(
            preds[i], held.layer_x(i), held.layer_score(i), th[i]
        )
        assert recall > 0.9, (i, recall)  # fitted for 0.95 on the calibration tokens
        assert predicted < 0.95  # it must skip something to be worth having
        assert truly < predicted


def test_allocate_sparsity_spends_it_where_error_is_cheap():
    g = sp.SPARSITY_GRID
    err = np.stack([g**2, 4 * g**2, 0.5 * g**2])
    alloc = sp.allocate_sparsity(err, 0.5)
    assert alloc.mean() == pytest.approx(0.5)
    assert alloc[1] < alloc[0] < alloc[2]


def test_per_layer_error_curves_and_thresholds(smollm2, recorded):
    rec, _ = recorded
    grid = np.array([0.0, 0.3, 0.6])
    err = sp.layer_error_curves(smollm2.transformer, rec, grid, max_tokens=32)
    assert err.shape == (30, 3) and (err[1] == 0).all()
    assert (np.diff(err[list(LAYERS)], axis=1) > 0).all()  # more sparsity, more error
    th = sp.calibrate_thresholds(rec, np.where(np.arange(30) == 13, 0.6, 0.3))
    assert (rec.layer_score(13) < th[13]).mean() == pytest.approx(0.6, abs=0.01)
    assert (rec.layer_score(0) < th[0]).mean() == pytest.approx(0.3, abs=0.01)


def test_weighted_scores_keep_the_target_and_cut_the_error(smollm2, recorded):
    rec, _ = recorded
    w = sp.neuron_weights(smollm2.transformer, rec)
    assert w[1] is None and w[13].shape == (1536,) and (w[13] > 0).all()
    grid = np.array([0.0, 0.5])
    plain = sp.layer_error_curves(smollm2.transformer, rec, grid, max_tokens=32)
    weighted = sp.layer_error_curves(smollm2.transformer, rec, grid, max_tokens=32, weights=w)
    assert weighted[13, 1] < plain[13, 1]
    th = sp.calibrate_thresholds(rec, 0.5, w)
    assert (rec.layer_score(13) * w[13] < th[13]).mean() == pytest.approx(0.5, abs=0.01)
