"""The committed corpus against the real target: greedy answers and cached features reproduce."""

from __future__ import annotations

import pytest
import torch
from jetflow.core.errors import DataError
from jetflow.core.target import Target
from jetflow.drafters.head_sizes import default_feature_layers
from jetflow.drafters.training.corpus import Corpus, default_corpus_dir
from jetflow.drafters.training.features import FeatureStore

pytestmark = pytest.mark.integration

CHECKED = (0, 1)  # two conversations: a full 256-token greedy answer costs ~20 s on two cores


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    folder = default_corpus_dir()
    if not (folder / "manifest.json").exists():
        pytest.skip(f"no committed corpus at {folder}")
    return Corpus(folder)


def test_manifest_matches_the_default_target(corpus: Corpus, real_target: Target) -> None:
    manifest = corpus.manifest
    assert manifest["target"] == {"name": real_target.name, "fingerprint": real_target.fingerprint()}
    assert manifest["counts"]["n_conversations"] == len(corpus) == len(set(corpus.ids))
    lengths = [corpus.sequence(i) for i in range(len(corpus))]
    assert sum(len(t) - p for t, p in lengths) == manifest["counts"]["n_response_tokens"]
    assert max(len(t) - p for t, p in lengths) <= manifest["settings"]["max_new_tokens"]


@pytest.mark.parametrize("index", CHECKED)
def test_answers_equal_transformers_generate(corpus: Corpus, real_target: Target, index: int) -> None:
    tokens, prompt_length = corpus.sequence(index)
    prompt = tokens[None, :prompt_length]
    new_tokens = corpus.manifest["settings"]["max_new_tokens"]
    with torch.inference_mode():
        out = real_target.model.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
    assert out[0, prompt_length:].tolist() == tokens[prompt_length:].tolist()


@pytest.mark.parametrize("index", CHECKED)
def test_cached_features_equal_a_teacher_forced_forward(
    corpus: Corpus, real_target: Target, index: int
) -> None:
    layers = default_feature_layers(real_target.num_layers)
    try:
        store = FeatureStore(corpus, layers)
    except DataError as error:  # a fresh clone has no feature cache: not a failure
        pytest.skip(f"no feature cache: {error}")
    tokens, _, features, final = store.sequence(index)
    with torch.inference_mode():
        out = real_target.model(tokens[None], output_hidden_states=True)
    n = len(tokens) - 1
    expected = torch.stack([out.hidden_states[i][0, :n] for i in layers], dim=1)
    for stored, reference in ((features, expected), (final, out.hidden_states[-1][0, :n])):
        error = (stored.float() - reference).abs()
        assert (error <= reference.abs() * 2**-9 + 1e-3).all(), float(error.max())
    logits = real_target.model.get_output_embeddings()(final.float())
    agree = (logits.argmax(-1) == out.logits[0, :n].argmax(-1)).float().mean()
    assert agree > 0.99, "the fp16 final state must give the teacher's argmax almost everywhere"
