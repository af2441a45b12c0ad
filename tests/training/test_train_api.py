"""``train(config)``: the whole of ``jetflow train`` as one library call, on the tiny target."""

from __future__ import annotations

import pytest
from jetflow.core.errors import ConfigError
from jetflow.drafters.checkpoint import load_checkpoint
from jetflow.drafters.jetflow.plugin import JetFlowDrafter
from jetflow.drafters.training import TrainConfig, train
from jetflow.drafters.training.curve import CURVE_PLOT
from jetflow.drafters.training.run import learned_drafter, shipped_recipe


def tiny_config(tmp_path, **overrides) -> TrainConfig:
    fields = {
        "drafter": "jetflow",
        "out": str(tmp_path / "run"),
        "steps": 4,
        "batch_sequences": 2,
        "anchors_per_sequence": 8,
        "holdout_sequences": 4,
        "eval_every": 2,
        "checkpoint_every": 2,
        "head": {"num_layers": 1, "block_size": 4, "feature_layers": [1, 2, 3]},
    }
    return TrainConfig.model_validate(fields | overrides)


def test_train_runs_from_python_and_ships_a_head(tiny_world, tiny_llama, ticking_clock, tmp_path) -> None:
    result = train(tiny_config(tmp_path), progress=False)
    assert result.main_process and result.steps == 4
    assert len(result.evaluation["agreement"]) == 3
    assert result.convergence is not None and result.convergence.final_step == 4
    assert (tmp_path / "run" / CURVE_PLOT).is_file()
    info, _ = load_checkpoint(result.final_checkpoint, tiny_llama, drafter="jetflow")
    assert info.state["step"] == 4 and info.architecture["block_size"] == 4
    assert info.recipe["eval_corpus"] is not None, "the recipe records the data the head saw"

    resumed = train(tiny_config(tmp_path, steps=6), resume=True, progress=False)
    assert resumed.steps == 6 and resumed.train_s > resumed.wall_s, "it went on from step 4"


def test_only_a_learned_drafter_can_be_trained() -> None:
    assert learned_drafter("jetflow") is JetFlowDrafter
    with pytest.raises(ConfigError, match="'ngram' has no trainable head"):
        learned_drafter("ngram")
    assert shipped_recipe("jetflow") == JetFlowDrafter.default_train_config()
