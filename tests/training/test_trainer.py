"""The shared trainer on a tiny random target: it learns, logs, checkpoints and resumes exactly."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from jetflow.core.errors import CheckpointMismatchError, ConfigError
from jetflow.drafters.checkpoint import load_checkpoint, read_checkpoint
from jetflow.drafters.training import TrainConfig
from jetflow.drafters.training.optim import OptimConfig, lr_factor

from tests.drafters.tiny_heads import quick_trainer, regenerated_store, tiny_head


def test_training_lowers_the_loss_and_raises_per_depth_agreement(tiny_llama, tmp_path) -> None:
    trainer = quick_trainer(tiny_llama, tmp_path, steps=40, eval_every=20)
    before = trainer.evaluate()
    result = trainer.fit()
    after = result.evaluation
    assert after["eval_loss"] < 0.6 * before["eval_loss"]
    assert len(after["agreement"]) == 5
    assert sum(after["agreement"]) / 5 > sum(before["agreement"]) / 5 + 0.1
    assert after["agreement"][0] > before["agreement"][0] + 0.1
    assert after["chain_accept"] > before["chain_accept"]

    records = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert [r["step"] for r in records if r.get("eval")] == [20, 40]
    assert sum(losses[-2:]) < sum(losses[:2])
    info, state = load_checkpoint(result.final_checkpoint, tiny_llama, drafter="jetflow")
    assert all(t.dtype == torch.float16 for t in state.values())
    assert info.state["step"] == 40 and info.state["agreement"] == after["agreement"]
    assert info.recipe["loss"]["kind"] == "forward-kl" and info.data["source"] == "tiny-greedy"


@pytest.mark.parametrize("kind", ["sft", "reverse-kl"])
def test_every_loss_trains(tiny_llama, tmp_path, kind: str) -> None:
    trainer = quick_trainer(tiny_llama, tmp_path, steps=12, loss={"kind": kind, "depth_decay": 4.0})
    before = trainer.evaluate()["eval_loss"]
    assert trainer.fit().evaluation["eval_loss"] < before


@pytest.mark.parametrize(
    ("precision", "step_dtype"), [("bfloat16", torch.bfloat16), ("float32", torch.float32)]
)
def test_precision_sets_the_dtype_of_training_products_only(
    tiny_llama, tmp_path, precision: str, step_dtype: torch.dtype
) -> None:
    trainer = quick_trainer(tiny_llama, tmp_path, steps=12, precision=precision)
    products: list[torch.dtype] = []
    trainer.head.fusion.proj.register_forward_hook(lambda module, args, out: products.append(out.dtype))
    before = trainer.evaluate()["eval_loss"]
    assert set(products) == {torch.float32}, "evaluation multiplies in fp32"
    products.clear()
    trainer.train_step()
    assert set(products) == {step_dtype}
    after = trainer.fit().evaluation["eval_loss"]
    assert after < before
    assert all(p.dtype == torch.float32 for p in trainer.head.parameters()), "master weights stay fp32"


def test_a_separate_eval_store_is_one_yardstick_for_every_data_size(tiny_llama, tmp_path) -> None:
    heldout = regenerated_store(tiny_llama, n=12, seed=1)
    small = quick_trainer(
        tiny_llama, tmp_path / "small", eval_store=heldout, max_sequences=20, holdout_sequences=8
    )
    full = quick_trainer(tiny_llama, tmp_path / "full", eval_store=heldout, holdout_sequences=8)
    assert small.train_ids.tolist() == list(range(20)), "every training sequence trains"
    assert full.train_ids.tolist() == list(range(48))
    assert small.eval_ids.tolist() == full.eval_ids.tolist() == list(range(8))

    same_head = quick_trainer(tiny_llama, tmp_path / "own", holdout_sequences=8)  # its own held-out split
    assert small.evaluate() == full.evaluate(), "same weights, same yardstick"
    assert same_head.evaluate() != small.evaluate()
    other = quick_trainer(
        tiny_llama,
        tmp_path / "other",
        eval_store=regenerated_store(tiny_llama, n=12, seed=2),
        holdout_sequences=8,
    )
    assert other.evaluate() != small.evaluate(), "evaluation reads the eval store"
    info, _ = read_checkpoint(small.fit().final_checkpoint)
    assert info.data["holdout_sequences"] == 8 and "eval_corpus" in info.data


def test_a_draft_vocabulary_is_chosen_from_response_frequencies(tiny_llama, tmp_path) -> None:
    from jetflow.drafters.training.examples import response_token_counts

    trainer = quick_trainer(tiny_llama, tmp_path, head=tiny_head(tiny_llama, draft_vocab_size=32), steps=20)
    counts = response_token_counts(trainer.store, trainer.train_ids.tolist(), 256)
    chosen = trainer.head.draft_tokens
    assert torch.equal(chosen, chosen.sort().values) and chosen.unique().numel() == 32
    assert counts[chosen].min() >= counts[torch.isin(torch.arange(256), chosen, invert=True)].max()
    before = trainer.evaluate()
    result = trainer.fit()
    assert result.evaluation["eval_loss"] < before["eval_loss"]
    assert sum(result.evaluation["agreement"]) > sum(before["agreement"])
    info, state = read_checkpoint(result.final_checkpoint)
    assert torch.equal(state["draft_tokens"], chosen)
    assert info.data["draft_vocab_size"] == 32 and 0 < info.data["draft_vocab_coverage"] <= 1


def test_resume_continues_exactly_where_the_run_stopped(tiny_llama, tmp_path) -> None:
    whole = quick_trainer(tiny_llama, tmp_path / "whole", steps=8, checkpoint_every=4)
    whole.fit()

    interrupted = quick_trainer(tiny_llama, tmp_path / "split", steps=8, checkpoint_every=4)
    interrupted.out.mkdir(parents=True)
    for _ in range(4):
        interrupted.train_step()
    interrupted.save()
    interrupted.train_step()  # lost: the run dies before its next checkpoint

    resumed = quick_trainer(tiny_llama, tmp_path / "split", head=tiny_head(tiny_llama, seed=5), steps=8)
    resumed.fit(resume=True, target=tiny_llama)
    assert resumed.step == 8
    for name, tensor in whole.head.state_dict().items():
        torch.testing.assert_close(resumed.head.state_dict()[name], tensor, atol=1e-6, rtol=1e-5)
    steps = sorted(p.name for p in (tmp_path / "split" / "checkpoints").iterdir())
    assert steps == ["step-0000004", "step-0000008"]
    _, final = read_checkpoint(tmp_path / "split" / "final")
    assert final.keys() == whole.head.state_dict().keys()


def test_training_time_adds_up_over_resumed_runs(tiny_llama, ticking_clock, tmp_path) -> None:
    first = quick_trainer(tiny_llama, tmp_path, steps=4, checkpoint_every=2)
    first_result = first.fit()
    resumed = quick_trainer(tiny_llama, tmp_path, steps=8, checkpoint_every=2)
    result = resumed.fit(resume=True)
    assert result.train_s >= first_result.train_s + result.wall_s > result.wall_s
    info, _ = read_checkpoint(result.final_checkpoint)
    assert info.state["train_s"] == pytest.approx(result.train_s, abs=0.1)
    records = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    elapsed = [record["elapsed_s"] for record in records]
    assert elapsed == sorted(elapsed) and elapsed[-1] >= first_result.train_s


def test_resume_refuses_a_run_with_another_head(tiny_llama, tmp_path) -> None:
    first = quick_trainer(tiny_llama, tmp_path, steps=2, checkpoint_every=1)
    first.fit()
    other = quick_trainer(tiny_llama, tmp_path, head=tiny_head(tiny_llama, num_layers=2), steps=4)
    with pytest.raises(CheckpointMismatchError, match="cannot resume"):
        other.fit(resume=True)


def test_a_warm_start_continues_from_a_heads_weights_and_step_with_a_fresh_optimiser(
    tiny_llama, tmp_path
) -> None:
    first = quick_trainer(tiny_llama, tmp_path / "first", steps=12, checkpoint_every=6)
    first.out.mkdir(parents=True)
    for _ in range(6):
        first.train_step()
    head_folder = first.save()

    warm = quick_trainer(tiny_llama, tmp_path / "warm", head=tiny_head(tiny_llama, seed=5), steps=12)
    warm.warm_start(head_folder, tiny_llama)
    assert warm.step == 6
    for name, tensor in first.head.state_dict().items():
        assert torch.equal(warm.head.state_dict()[name], tensor)
    assert warm.optimizer.state_dict()["state"] == {}, "the moments start at zero"
    optim = warm.config.optim
    rates = [warm.train_step()["lr"] for _ in range(optim.warmup_steps + 1)]
    expected = [
        optim.lr * lr_factor(6 + i, optim, 12) * min(1.0, (i + 1) / optim.warmup_steps)
        for i in range(optim.warmup_steps + 1)
    ]
    assert rates == pytest.approx(expected), "the schedule goes on from step 6 and re-warms"
    assert rates[0] < optim.lr * lr_factor(6, optim, 12) / 2


def test_a_warm_started_run_resumes_exactly(tiny_llama, tmp_path) -> None:
    first = quick_trainer(tiny_llama, tmp_path / "first", steps=4)
    head_folder = first.fit().final_checkpoint  # the shipped fp16 head is enough to go on from

    whole = quick_trainer(tiny_llama, tmp_path / "whole", steps=12, warm_start=str(head_folder))
    whole.fit(target=tiny_llama)
    interrupted = quick_trainer(
        tiny_llama, tmp_path / "split", steps=12, checkpoint_every=4, warm_start=str(head_folder)
    )
    interrupted.train_step = _interrupt_after(interrupted.train_step, calls=5)
    with pytest.raises(KeyboardInterrupt):
        interrupted.fit(target=tiny_llama)
    assert (tmp_path / "split" / "checkpoints" / "step-0000008").is_dir()
    resumed = quick_trainer(
        tiny_llama, tmp_path / "split", steps=12, warm_start=str(head_folder)
    )  # the resumable checkpoint wins over the warm start
    resumed.fit(resume=True, target=tiny_llama)
    for name, tensor in whole.head.state_dict().items():
        torch.testing.assert_close(resumed.head.state_dict()[name], tensor, atol=1e-6, rtol=1e-5)
    info, _ = read_checkpoint(tmp_path / "split" / "final")
    assert info.recipe["warm_start"] == str(head_folder) and info.state["step"] == 12
    logged = [json.loads(line)["step"] for line in (tmp_path / "split" / "train_log.jsonl").open()]
    assert logged == sorted(logged) and logged[0] > 4, "the log goes on from the head's step"


def _interrupt_after(step_fn, calls: int):
    counter = itertools.count()

    def step() -> dict[str, float]:
        if next(counter) == calls:
            raise KeyboardInterrupt
        return step_fn()

    return step


def test_a_warm_start_refuses_another_head_and_a_finished_run(tiny_llama, tmp_path) -> None:
    head_folder = quick_trainer(tiny_llama, tmp_path / "first", steps=4).fit().final_checkpoint
    other = quick_trainer(tiny_llama, tmp_path / "other", head=tiny_head(tiny_llama, num_layers=2), steps=8)
    with pytest.raises(CheckpointMismatchError, match="cannot warm-start"):
        other.warm_start(head_folder)
    done = quick_trainer(tiny_llama, tmp_path / "done", steps=4)
    with pytest.raises(ConfigError, match="at step 4 already"):
        done.warm_start(head_folder)


def test_learning_rate_warms_up_then_decays_by_cosine() -> None:
    config = OptimConfig(warmup_steps=10, min_lr_ratio=0.1)
    factors = [lr_factor(step, config, total_steps=110) for step in range(110)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert factors[10] == pytest.approx(1.0) and factors[60] == pytest.approx(0.55)
    assert factors[-1] == pytest.approx(0.1, abs=1e-3)
    assert all(a >= b for a, b in itertools.pairwise(factors[10:]))


def test_the_wsd_schedule_holds_the_peak_rate_then_decays_linearly() -> None:
    config = OptimConfig(warmup_steps=10, min_lr_ratio=0.1, schedule="wsd", decay_steps=20)
    factors = [lr_factor(step, config, total_steps=110) for step in range(111)]
    assert factors[9] == pytest.approx(1.0) and set(factors[10:91]) == {1.0}
    assert factors[100] == pytest.approx(0.55) and factors[110] == pytest.approx(0.1)
    assert all(a >= b for a, b in itertools.pairwise(factors[10:]))
    with pytest.raises(ValueError, match="decay_steps"):
        OptimConfig(schedule="wsd")


def test_a_recipe_extends_its_base_key_by_key(tmp_path) -> None:
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "base.toml").write_text(
        'steps = 7\nout = "runs/base"\n[loss]\nkind = "sft"\ndepth_decay = 4.0\n[head]\nnum_layers = 2\n'
    )
    recipe = tmp_path / "recipe.toml"
    recipe.write_text('base = "shared/base.toml"\nout = "runs/recipe"\n[loss]\ndepth_decay = 2.0\n')
    config = TrainConfig.from_toml(recipe, settings={"head": {"block_size": 4}})
    assert (config.steps, config.out, config.loss.kind, config.loss.depth_decay) == (
        7,
        "runs/recipe",
        "sft",
        2.0,
    )
    assert config.head == {"num_layers": 2, "block_size": 4}


def test_a_recipe_with_a_missing_or_circular_base_is_refused(tmp_path) -> None:
    recipe = tmp_path / "recipe.toml"
    recipe.write_text('base = "gone.toml"\n')
    with pytest.raises(ConfigError, match=r"gone\.toml"):
        TrainConfig.from_toml(recipe)
    other = tmp_path / "other.toml"
    other.write_text('base = "recipe.toml"\n')
    recipe.write_text('base = "other.toml"\n')
    with pytest.raises(ConfigError, match="in a circle"):
        TrainConfig.from_toml(recipe)
    recipe.write_text("base = 3\n")
    with pytest.raises(ConfigError, match="base must be the path of another config file"):
        TrainConfig.from_toml(recipe)


def test_a_store_of_other_layers_is_refused(tiny_llama, tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"holds layers \[1, 2, 3\], but the head reads \[1, 2\]"):
        quick_trainer(tiny_llama, tmp_path, head=tiny_head(tiny_llama, feature_layers=(1, 2)))


def test_train_config_loads_from_toml(tmp_path) -> None:
    path = tmp_path / "train.toml"
    path.write_text('steps = 7\n[loss]\nkind = "sft"\n[optim]\nlr = 1e-3\n[head]\nnum_layers = 1\n')
    config = TrainConfig.from_toml(path, out="elsewhere", features=None)
    assert (config.steps, config.loss.kind, config.optim.lr, config.head, config.out) == (
        7,
        "sft",
        1e-3,
        {"num_layers": 1},
        "elsewhere",
    )
    path.write_text("stepz = 7\n")
    with pytest.raises(ConfigError, match="stepz"):
        TrainConfig.from_toml(path)
