"""Regeneration through the batched speculative engine: the plain loop's corpus, token for token."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from jetflow.cli import data as data_cli
from jetflow.cli.main import main
from jetflow.core.config import GenerateConfig, build_config
from jetflow.core.engine import Engine
from jetflow.core.errors import ConfigError
from jetflow.core.target import Target
from jetflow.drafters.training import greedy
from jetflow.drafters.training import regenerate as regen
from jetflow.drafters.training.corpus import Corpus

from tests.conftest import make_tiny_target
from tests.drafters.tiny_heads import jetflow_registered, save_head, tiny_head
from tests.training.conftest import TinyDataTarget

MAX_NEW = 12
N_PROMPTS = 10
SHARD = 4


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _prompts(n: int = N_PROMPTS, seed: int = 1) -> list[regen.Prompt]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 40, (n,), generator=generator).tolist()
    return [
        regen.Prompt(f"p{i}", tuple(torch.randint(2, 256, (m,), generator=generator).tolist()))
        for i, m in enumerate(lengths)
    ]


@pytest.fixture(scope="module")
def target() -> Target:
    """A tiny target whose EOS set ends some answers early (at different lengths)."""
    target = make_tiny_target("llama", seed=3)
    free = greedy.greedy_generate(target.model, [torch.tensor(p.token_ids) for p in _prompts()], MAX_NEW, [])
    eos = sorted({int(free[0].response[2]), int(free[5].response[6]), int(free[8].response[9]), 1})
    target.model.generation_config.eos_token_id = eos
    return target


@pytest.fixture(scope="module")
def plain(target: Target, tmp_path_factory: pytest.TempPathFactory) -> Corpus:
    """The plain loop's tokens-only corpus, the reference every engine must reproduce."""
    out = tmp_path_factory.mktemp("plain") / "corpus"
    return regen.regenerate(target, _prompts(), out, max_new_tokens=MAX_NEW, batch_size=3, shard_size=SHARD)


@pytest.fixture(scope="module")
def head_checkpoint(target: Target, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """An (untrained) tiny jetflow head for the target, registered while the module runs."""
    with jetflow_registered():
        yield save_head(tmp_path_factory.mktemp("head"), target, tiny_head(target))


def _engine(target: Target, drafter: str, **fields) -> Engine:
    config = {"drafter": drafter, "max_new_tokens": MAX_NEW, "compile": False} | fields
    return Engine(build_config(GenerateConfig, config), target)


def _assert_same_corpus(corpus: Corpus, reference: Corpus) -> None:
    assert corpus.ids == reference.ids == [p.id for p in _prompts()]
    assert [len(s) for s in corpus.shards] == [len(s) for s in reference.shards]
    for mine, theirs in zip(corpus.shards, reference.shards, strict=True):
        assert torch.equal(mine.tokens, theirs.tokens)
        assert torch.equal(mine.offsets, theirs.offsets)
        assert torch.equal(mine.prompt_lengths, theirs.prompt_lengths)
    assert corpus.manifest["shards"] == reference.manifest["shards"]  # same files, counts, checksums
    assert corpus.manifest["counts"] == reference.manifest["counts"]


def test_the_reference_corpus_has_answers_ended_by_eos(target: Target, plain: Corpus) -> None:
    """Some answers stop early with their EOS token kept, others run to max_new_tokens."""
    eos = target.eos_token_ids
    lengths = []
    for i in range(len(plain)):
        tokens, prompt_length = plain.sequence(i)
        response = tokens[prompt_length:].tolist()
        lengths.append(len(response))
        if len(response) < MAX_NEW:
            assert response[-1] in eos and not eos & set(response[:-1])
    assert min(lengths) < MAX_NEW and max(lengths) == MAX_NEW
    assert plain.manifest["settings"]["decoder"] == regen.PLAIN_DECODER
    assert plain.manifest["regeneration"]["response_tokens_per_s"] > 0


@pytest.mark.parametrize(
    ("drafter", "fields"),
    [
        pytest.param("ngram", {"tree": {"budget": 4}}, id="ngram"),
        pytest.param("none", {}, id="none"),
        pytest.param("jetflow", {"tree": {"budget": 6, "width": 2}}, id="jetflow"),
    ],
)
def test_an_engine_writes_the_plain_loops_corpus(
    target: Target,
    plain: Corpus,
    head_checkpoint: Path,
    tmp_path: Path,
    drafter: str,
    fields: dict,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if drafter == "jetflow":
        fields = fields | {"drafter_params": {"checkpoint": str(head_checkpoint)}}
    engine = _engine(target, drafter, **fields)
    results = []
    original = engine.generate_batch
    monkeypatch.setattr(
        engine, "generate_batch", lambda *a, **k: results.extend(out := original(*a, **k)) or out
    )
    monkeypatch.setattr(regen, "generate_chunk", _forbidden)
    corpus = regen.regenerate(
        target,
        _prompts(),
        tmp_path / "corpus",
        max_new_tokens=MAX_NEW,
        batch_size=3,
        shard_size=SHARD,
        engine=engine,
    )
    _assert_same_corpus(corpus, plain)
    assert {r.finish_reason for r in results} == {"eos", "length"}
    settings = corpus.manifest["settings"]
    assert settings["decoder"] == engine.method != regen.PLAIN_DECODER
    assert settings["budget"] == engine.budget and settings["budget_source"] == engine.budget_source
    assert settings["compiled"] is False
    assert corpus.manifest["regeneration"]["response_tokens_per_s"] > 0
    assert corpus.manifest["regeneration"]["tokens_per_s"] > 0
    if drafter == "ngram":  # it really decoded speculatively: drafts were accepted
        assert sum(step.accepted for r in results for step in r.steps) > 0
    if drafter == "none":
        assert settings["decoder"] == "ar" and settings["budget"] is None
    else:
        assert settings["budget"] == fields["tree"]["budget"] and settings["budget_source"] == "fixed"


def _forbidden(*args, **kwargs):
    raise AssertionError("the plain loop ran although an engine was given")


def test_an_engine_run_resumes_after_its_last_complete_shard(
    target: Target, plain: Corpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _engine(target, "ngram", tree={"budget": 4})
    original, calls, interrupts = engine.generate_batch, [], [KeyboardInterrupt]

    def interrupted(prompts, **kwargs):
        calls.append(len(prompts))
        if len(calls) == 2 and interrupts:
            raise interrupts.pop()
        return original(prompts, **kwargs)

    monkeypatch.setattr(engine, "generate_batch", interrupted)
    kwargs = dict(max_new_tokens=MAX_NEW, batch_size=3, shard_size=SHARD, engine=engine)
    with pytest.raises(KeyboardInterrupt):
        regen.regenerate(target, _prompts(), tmp_path / "corpus", **kwargs)
    assert len(Corpus(tmp_path / "corpus")) == SHARD
    calls.clear()
    resumed = regen.regenerate(target, _prompts(), tmp_path / "corpus", **kwargs)
    assert calls == [4, 2], "only the missing shards are decoded"
    _assert_same_corpus(resumed, plain)


def test_a_plain_run_and_an_engine_continue_each_others_corpus(
    target: Target, plain: Corpus, tmp_path: Path
) -> None:
    """The decoder is no resume setting: either one continues the other's shards, same tokens."""
    out, prompts = tmp_path / "corpus", _prompts()
    engine = _engine(target, "ngram", tree={"budget": 4})
    common = dict(max_new_tokens=MAX_NEW, batch_size=3, shard_size=SHARD)
    regen.regenerate(target, prompts[:SHARD], out, **common)
    regen.regenerate(target, prompts[: 2 * SHARD], out, **common, engine=engine)
    mixed = regen.regenerate(target, prompts, out, **common)
    _assert_same_corpus(mixed, plain)


def test_an_engine_is_refused_where_its_answers_or_features_would_differ(
    target: Target, tmp_path: Path
) -> None:
    out = tmp_path / "corpus"
    engine = _engine(target, "ngram", tree={"budget": 4})
    with pytest.raises(ConfigError, match="features need the states of every token"):
        regen.regenerate(target, _prompts(), out, max_new_tokens=MAX_NEW, layers=(1, 2), engine=engine)
    with pytest.raises(ConfigError, match="stop="):
        regen.regenerate(target, _prompts(), out, engine=_engine(target, "ngram", stop=("x",)))
    with pytest.raises(ConfigError, match="stop_at_eos=False"):
        regen.regenerate(target, _prompts(), out, engine=_engine(target, "none", stop_at_eos=False))
    other = make_tiny_target("llama", seed=9)
    with pytest.raises(ConfigError, match="not the target"):
        regen.regenerate(target, _prompts(), out, engine=_engine(other, "none"))
    assert not out.exists(), "nothing is written before the engine is checked"


# ---- the command ----

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
LINES = ["w1 w2 w3", "w5 w6 w7 w5 w6 w7", "w4 w8", "w10 w11 w12 w13", "w2 w2 w2 w2", "w9 w1"]


@pytest.fixture
def tiny(tiny_data_target: TinyDataTarget) -> tuple[Target, Path]:
    return tiny_data_target(CHAT_TEMPLATE, [{"prompt": p} for p in LINES], {False: set(), True: set()})


def _argv(prompts: Path, out: Path, *extra: str) -> list[str]:
    return [
        *("data", "regenerate", "--source", f"file:{prompts}", "--n", "6", "--max-new-tokens", "10"),
        *("--shard-size", "4", "--batch-size", "3", "--threads", "1", "--out", str(out), *extra),
    ]


def test_the_command_decodes_through_the_engine_with_drafter(tiny, tmp_path: Path) -> None:
    _, prompts = tiny
    assert main(_argv(prompts, tmp_path / "plain", "--no-features")) == 0
    engine_argv = _argv(prompts, tmp_path / "ngram", "--no-features", "--drafter", "ngram", "--budget", "5")
    assert main(engine_argv) == 0
    plain, drafted = Corpus(tmp_path / "plain"), Corpus(tmp_path / "ngram")
    assert drafted.ids == plain.ids and len(drafted) == 6
    assert drafted.manifest["shards"] == plain.manifest["shards"]
    for i in range(len(plain)):
        assert torch.equal(drafted.sequence(i)[0], plain.sequence(i)[0])
    assert plain.manifest["settings"]["decoder"] == "plain" and "budget" not in plain.manifest["settings"]
    settings = drafted.manifest["settings"]
    assert settings["decoder"].startswith("ngram:") and settings["budget"] == 5
    assert settings["budget_source"] == "fixed"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        pytest.param(
            ["--drafter", "ngram"], "--drafter decodes tokens only: add --no-features", id="features"
        ),
        pytest.param(["--no-features", "--budget", "3"], "--budget needs --drafter", id="budget-alone"),
        pytest.param(
            ["--no-features", "--drafter", "ngram", "--turn", "2"], "decodes first turns only", id="turn-2"
        ),
        pytest.param(["--no-features", "--drafter", "nosuch"], "nosuch", id="unknown-drafter"),
        pytest.param(["--no-features", "--drafter", "ngram", "--budget", "many"], "budget", id="bad-budget"),
    ],
)
def test_the_command_refuses_bad_drafter_flags_before_loading(
    tiny,
    tmp_path: Path,
    extra: list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, prompts = tiny
    monkeypatch.setattr(data_cli, "_load_target", _forbidden)
    assert main(_argv(prompts, tmp_path / "corpus", *extra)) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "corpus").exists()
