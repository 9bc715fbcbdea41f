"""The forward pass held to an independent float reference: transformers + torch
(CPU) loading the same GGUF with gguf_file= (it dequantizes every tensor)."""

import numpy as np
import pytest

pytestmark = pytest.mark.slow

PROMPTS = [
    "The history of the Roman Empire",
    "def fibonacci(n):",
    "Explain photosynthesis to a child.",
]
FORCED = 64
GREEDY = 32


@pytest.fixture(scope="module")
def hf_model(smollm2_path):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, torch_dtype=torch.float32
    )
    model.eval()
    return model


def _hf_greedy(hf_model, ids, n):
    import torch

    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False
        )
    return out[0].tolist()


def test_teacher_forced_agreement_and_greedy(smollm2, hf_model):
    import torch

    agree, total, max_diff, same_greedy = 0, 0, 0.0, 0
    for prompt in PROMPTS:
        ids = smollm2.tokenize(smollm2.render_chat([{"role": "user", "content": prompt}]))
        seq = _hf_greedy(hf_model, ids, FORCED)
        with torch.no_grad():
            ref = hf_model(torch.tensor([seq])).logits[0].numpy()
        ours = smollm2.logits(seq)
        assert ours.shape == ref.shape
        lo = len(ids) - 1
        a = ours[lo : lo + FORCED].argmax(-1)
        b = ref[lo : lo + FORCED].argmax(-1)
        agree += int((a == b).sum())
        total += FORCED
        max_diff = max(max_diff, float(np.abs(ours - ref).max()))
        smollm2.generator.cache.clear()
        for _ in smollm2.generate(ids, max_tokens=GREEDY, temperature=0.0):
            pass
        ours_greedy = smollm2.generator.cache.tokens[len(ids) :]
        # the last sampled token is not fed back, so the cache holds GREEDY - 1 of them
        same_greedy += ours_greedy == seq[len(ids) : len(ids) + len(ours_greedy)]
        assert len(ours_greedy) >= GREEDY - 1
    rate = agree / total
    print(f"argmax agreement {rate:.4f} over {total} positions; max |logit diff| {max_diff:.2e}")
    assert rate >= 0.98
    assert same_greedy >= 2
    assert max_diff < 0.05
