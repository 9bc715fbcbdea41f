"""CATS thresholds, the thresholded reference executor and the low-rank predictor on the
real SmolLM2 (a few layers, small calibration sets, so this stays well under a minute)."""

import numpy as np
import pytest

from edgerun.offload import sparsity as sp
from edgerun.tools.perplexity import calibration_text, evaluation_text

LAYERS = (0, 13, 29)


@pytest.fixture(scope="module")
def recorded(smollm2):
    enc = smollm2.tokenizer.encode
    cal = enc(calibration_text(), add_bos=False, parse_special=False)[:192]
    held = enc(evaluation_text(), add_bos=False, parse_special=False)[:128]
    return (
        sp.collect_activations(smollm2, cal, layers=LAYERS),
        sp.collect_activations(smollm2, held, layers=LAYERS),
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
    sp.collect_activations(smollm2, ids, layers=(3,))
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
    preds = sp.fit_predictors(smollm2, rec, th, rank=128, recall=0.95, layers=LAYERS)
    for i in LAYERS:
        recall, predicted, truly = sp.predictor_recall(
            preds[i], held.layer_x(i), held.layer_score(i), th[i]
        )
        assert recall > 0.9, (i, recall)  # fitted for 0.95 on the calibration tokens
        assert predicted < 0.95  # it must skip something to be worth having
        assert truly < predicted
