"""The forward pass held to an independent float reference: transformers + torch
(CPU) loading the same GGUF with gguf_file= (it dequantizes every tensor).

Teacher-forced on 3 prompts x 64 tokens (the reference's own greedy
continuation): argmax agreement >= 98%; our greedy continuation equals the
reference's for at least 2 of 3 prompts.
"""

import numpy as np
import pytest

import edgerun
from edgerun import registry
from edgerun.sampling import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The history of the Roman Empire",
    "def fibonacci(n):",
    "Explain photosynthesis to a child.",
]
FORCED = 64
GREEDY = 32
MODELS = ["smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m"]


@pytest.fixture(scope="module", params=MODELS)
def pair(request):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    path = registry.resolve_path(registry.find(request.param))
    ours = edgerun.load(path, n_ctx=512, threads=2)
    ref = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, torch_dtype=torch.float32
    )
    ref.eval()
    return request.param, ours, ref


def _prompt_ids(model, text):
    if model.chat_template:
        return model.tokenize(model.render_chat([{"role": "user", "content": text}]))
    return model.tokenize(text)


def test_teacher_forced_agreement_and_greedy(pair):
    import torch

    name, ours, ref = pair
    agree, total, max_diff, same_greedy = 0, 0, 0.0, 0
    for prompt in PROMPTS:
        ids = _prompt_ids(ours, prompt)
        with torch.no_grad():
            seq = ref.generate(
                torch.tensor([ids]), max_new_tokens=FORCED, min_new_tokens=FORCED, do_sample=False
            )[0].tolist()
            ref_logits = ref(torch.tensor([seq])).logits[0].numpy()
        our_logits = ours.logits(seq)
        assert our_logits.shape == ref_logits.shape
        lo = len(ids) - 1
        a = our_logits[lo : lo + FORCED].argmax(-1)
        b = ref_logits[lo : lo + FORCED].argmax(-1)
        agree += int((a == b).sum())
        total += FORCED
        max_diff = max(max_diff, float(np.abs(our_logits - ref_logits).max()))
        ours.generator.cache.clear()
        # EOS is suppressed in the reference's continuation (min_new_tokens), so here too
        greedy = SamplingParams(temperature=0.0)
        text = "".join(ours.generator.stream(ids, greedy, max_tokens=GREEDY, stop_ids=()))
        same_greedy += text == ours.detokenize(seq[len(ids) : len(ids) + GREEDY])
    rate = agree / total
    print(
        f"{name}: argmax agreement {rate:.4f} over {total} positions; "
        f"max |logit diff| {max_diff:.2e}; greedy {same_greedy}/3 identical"
    )
    assert rate >= 0.98
    assert same_greedy >= 2
