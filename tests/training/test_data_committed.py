"""The committed corpus against the real target: greedy answers and cached features reproduce."""

from __future__ import annotations

import pytest
import torch
from jetflow.bench.runner import turn_prompt_ids
from jetflow.core.errors import DataError
from jetflow.core.packed_weights import unpacked
from jetflow.core.precision import resolve_dtype
from jetflow.core.target import Target
from jetflow.data import prompt_sets
from jetflow.drafters.head_sizes import default_feature_layers
from jetflow.drafters.training.corpus import Corpus
from jetflow.drafters.training.corpus_folders import default_corpus_dir, heldout_dir, second_turn_dir
from jetflow.drafters.training.feature_cache import FeatureStore

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
    with torch.inference_mode(), unpacked(real_target.model):  # the corpus was made on plain kernels
        out = real_target.model.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
    assert out[0, prompt_length:].tolist() == tokens[prompt_length:].tolist()


#: Largest error allowed per stored state vector, ``|stored - forward| / |forward|``, by the precision
#: the target ran in. fp32 states differ only by the fp16 storage; bf16 ones also by the rounding of a
#: padded batch against a lone sequence (about 2^-6 at the worst position; a wrong position or layer
#: is off by about 1).
ROW_TOLERANCE = {"float32": 2**-9, "bfloat16": 2**-4}


@pytest.mark.parametrize("index", CHECKED)
def test_cached_features_equal_a_teacher_forced_forward(
    corpus: Corpus, real_target: Target, index: int
) -> None:
    layers = default_feature_layers(real_target.num_layers)
    try:  # only the first shard needs to be cached
        store = FeatureStore(corpus, layers, limit=max(CHECKED) + 1)
    except DataError as error:  # a fresh clone has no feature cache: not a failure
        pytest.skip(f"no feature cache: {error}")
    (precision,) = store.manifest["features_computed_in"]
    if precision not in ROW_TOLERANCE:
        pytest.skip(f"features computed in {precision}: no forward to compare them with")
    target = real_target if precision == "float32" else Target.load("default", resolve_dtype(precision))
    tokens, _, features, final = store.sequence(index)
    with torch.inference_mode():
        out = target.model(tokens[None], output_hidden_states=True)
    n = len(tokens) - 1
    expected = torch.stack([out.hidden_states[i][0, :n] for i in layers], dim=1).float()
    for stored, reference in ((features, expected), (final, out.hidden_states[-1][0, :n].float())):
        error = (stored.float() - reference).norm(dim=-1) / reference.norm(dim=-1)
        assert float(error.max()) <= ROW_TOLERANCE[precision], float(error.max())
    logits = target.model.get_output_embeddings()(final.to(target.dtype))
    agree = (logits.argmax(-1) == out.logits[0, :n].argmax(-1)).float().mean()
    assert agree > 0.99, "the fp16 final state must give the teacher's argmax almost everywhere"


@pytest.fixture(scope="module")
def second_turns(corpus: Corpus) -> Corpus:
    folder = second_turn_dir(corpus.path)
    if not (folder / "manifest.json").exists():
        pytest.skip(f"no committed second turns at {folder}")
    return Corpus(folder)


def test_second_turns_follow_the_first_answers_as_the_benchmark_builds_turn_two(
    corpus: Corpus, second_turns: Corpus, real_target: Target
) -> None:
    """A second-turn prompt is MT-Bench's turn-2 prompt with the corpus's own first answer."""
    samples = {s.id: s for s in prompt_sets.split_sharegpt(prompt_sets.load_sharegpt())[0]}
    assert set(second_turns.ids) <= set(corpus.ids)
    sample_id = second_turns.ids[0]
    tokens, prompt_length = corpus.sequence(corpus.ids.index(sample_id))
    answer = real_target.decode(tokens[prompt_length:])
    expected = turn_prompt_ids(real_target, samples[sample_id], 1, [answer])
    tokens, prompt_length = second_turns.sequence(0)
    assert tuple(tokens[:prompt_length].tolist()) == expected
    new_tokens = second_turns.manifest["settings"]["max_new_tokens"]
    with torch.inference_mode(), unpacked(real_target.model):
        out = real_target.model.generate(
            tokens[None, :prompt_length], max_new_tokens=new_tokens, do_sample=False
        )
    assert out[0, prompt_length:].tolist() == tokens[prompt_length:].tolist()


def test_the_evaluation_corpus_answers_held_out_conversations_only(
    corpus: Corpus, real_target: Target
) -> None:
    """Every conversation of ``<name>-heldout`` is in the held-out split and in no training corpus."""
    folder = heldout_dir(corpus.path)
    if not (folder / "manifest.json").exists():
        pytest.skip(f"no committed evaluation corpus at {folder}")
    heldout = Corpus(folder)
    training = set(corpus.ids)
    second = second_turn_dir(corpus.path)
    if (second / "manifest.json").exists():
        training |= set(Corpus(second).ids)
    assert heldout.manifest["source"] == "sharegpt-heldout"
    assert set(heldout.ids) <= {s.id for s in prompt_sets.load_sharegpt_heldout()}
    assert not set(heldout.ids) & training
    tokens, prompt_length = heldout.sequence(0)
    new_tokens = heldout.manifest["settings"]["max_new_tokens"]
    with torch.inference_mode(), unpacked(real_target.model):
        out = real_target.model.generate(
            tokens[None, :prompt_length], max_new_tokens=new_tokens, do_sample=False
        )
    assert out[0, prompt_length:].tolist() == tokens[prompt_length:].tolist()
