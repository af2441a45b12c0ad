"""The speculators export: config and tensors against the format, against the head, and refusals."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from jetflow.bench.vllm_methods import chain_lengths
from jetflow.cli.main import main
from jetflow.core.errors import ConfigError, DataError
from jetflow.core.registry import default_registry
from jetflow.drafters.blocks import FrozenTargetParts
from jetflow.drafters.checkpoint import CheckpointInfo, save_checkpoint, target_record
from jetflow.drafters.learned import LearnedDrafter
from jetflow.export.compat import NotExportableError, dflash_differences
from jetflow.export.dflash import choose_mask_token
from jetflow.export.exporter import build_export
from jetflow.export.folder import read_export, write_export
from jetflow.export.schema import CONFIG_JSON, DFlashConfig

PLAIN = {"num_layers": 2, "block_size": 4, "anchored_slots": False, "draft_vocab_size": 40}


def make_checkpoint(target, folder, drafter="jetflow", seed=0, base=PLAIN, **options):
    """A randomly initialised head with a shuffled draft vocabulary, saved as jetflow saves heads."""
    torch.manual_seed(seed)
    head = default_registry().get("drafter", drafter).new_head(target, base | options)
    with torch.no_grad():
        for parameter in head.parameters():  # norms away from 1, so a swapped tensor shows
            parameter.add_(torch.randn_like(parameter) * 0.1)
        if head.draft_tokens is not None:
            head.draft_tokens.copy_(torch.randperm(target.vocab_size)[: head.draft_tokens.numel()])
    info = CheckpointInfo(
        drafter, head.config.model_dump(), target_record(target, head.config.feature_layers)
    )
    save_checkpoint(folder, head, info)
    return head


@pytest.fixture
def exported(tiny_llama, tmp_path):
    head = make_checkpoint(tiny_llama, tmp_path / "ckpt")
    export = build_export("jetflow", tiny_llama, "tiny", params={"checkpoint": str(tmp_path / "ckpt")})
    return head, export


def test_config_matches_the_head_and_the_format(exported, tiny_llama) -> None:
    head, export = exported
    config = DFlashConfig.model_validate(json.loads(export.config.model_dump_json()))
    layer = config.transformer_layer_config
    assert config.speculators_model_type == "dflash" and config.causal  # jetflow: the causal in-block mask
    assert config.aux_hidden_state_layer_ids == head.config.feature_layers  # hidden_states[i]: vLLM's aux ids
    assert config.speculators_config.proposal_methods[0].speculative_tokens == head.config.block_size - 1
    assert (layer.num_hidden_layers, layer.head_dim, layer.vocab_size) == (2, head.config.head_dim, 256)
    assert layer.rope_parameters["rope_theta"] == head.config.rope_theta
    assert config.draft_vocab_size == 40 and config.mask_token_id not in set(head.draft_tokens.tolist())
    assert config.speculators_config.verifier.name_or_path == "tiny"
    assert config.speculators_config.verifier.architectures == ("LlamaForCausalLM",)


def test_every_head_tensor_lands_once_under_vllms_name(exported, tiny_llama) -> None:
    head, export = exported
    tensors, state = export.tensors, head.state_dict()
    assert set(tensors) == set(export.config.expected_tensors())
    pairs = {"fc.weight": "fusion.proj.weight", "hidden_norm.weight": "fusion.norm.weight"}
    pairs |= {"norm.weight": "norm.weight", "layers.1.self_attn.k_norm.weight": "layers.1.attn.k_norm.weight"}
    pairs |= {"layers.0.input_layernorm.weight": "layers.0.input_norm.weight"}
    pairs |= {"layers.1.post_attention_layernorm.weight": "layers.1.post_norm.weight"}
    pairs |= {"layers.0.mlp.down_proj.weight": "layers.0.mlp.down_proj.weight"}
    for name, source in pairs.items():
        assert torch.equal(tensors[name], state[source]), name
    used = sum(t.numel() for n, t in tensors.items() if n not in {"lm_head.weight", "d2t", "t2d"})
    own = sum(t.numel() for n, t in state.items() if n not in {"mask_embedding", "draft_tokens"})
    assert used == own  # nothing dropped, nothing invented
    assert torch.equal(export.mask_embedding, state["mask_embedding"])


def test_the_draft_vocabulary_maps_onto_the_targets_lm_head(exported, tiny_llama) -> None:
    head, export = exported
    tokens = head.draft_tokens
    lm = tiny_llama.model.get_output_embeddings().weight
    assert torch.equal(export.tensors["lm_head.weight"], lm[tokens])
    assert torch.equal(torch.arange(40) + export.tensors["d2t"], tokens)  # vLLM: target id = i + d2t[i]
    assert torch.equal(export.tensors["t2d"].nonzero().flatten(), tokens.sort().values)


def _vllm_dflash_draft(tensors, config, embed, features, anchor_id, mask_id) -> torch.Tensor:
    """What vLLM's DFlash model computes for one block (qwen3_dflash.py, read, restated in torch):
    fc -> hidden_norm -> per layer k/v (k_norm, rope) of the context; the block [anchor, mask...]
    at positions c.. through Qwen3 layers under the in-block mask; norm; lm_head; d2t. Token ids [D]."""
    layer, eps = config.transformer_layer_config, config.transformer_layer_config.rms_norm_eps
    d, heads, kv_heads = layer.head_dim, layer.num_attention_heads, layer.num_key_value_heads
    theta = layer.rope_parameters["rope_theta"]

    def norm(x, name):
        return F.rms_norm(x, (x.shape[-1],), tensors[name], eps)

    def rope(x, positions):  # neox style, [n, heads, d]
        inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
        angles = positions[:, None].float() * inv
        cos, sin = (
            torch.cat([angles, angles], -1).cos()[:, None],
            torch.cat([angles, angles], -1).sin()[:, None],
        )
        return x * cos + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1) * sin

    c, size = features.shape[0], config.speculators_config.proposal_methods[0].speculative_tokens + 1
    context = norm(features.flatten(1) @ tensors["fc.weight"].T, "hidden_norm.weight")
    x = embed(torch.tensor([anchor_id] + [mask_id] * (size - 1)))
    positions = torch.arange(c, c + size)
    visible = torch.ones(size, c + size, dtype=torch.bool)
    if config.causal:
        visible[:, c:] = torch.ones(size, size, dtype=torch.bool).tril()
    for i in range(layer.num_hidden_layers):
        p = f"layers.{i}."

        def proj(v, name, p=p):
            return v @ tensors[p + name + ".weight"].T

        y = norm(x, p + "input_layernorm.weight")
        q = rope(
            norm(proj(y, "self_attn.q_proj").view(size, heads, d), p + "self_attn.q_norm.weight"), positions
        )
        keys = [proj(context, "self_attn.k_proj"), proj(y, "self_attn.k_proj")]
        k = torch.cat([k.view(-1, kv_heads, d) for k in keys])
        k = rope(norm(k, p + "self_attn.k_norm.weight"), torch.arange(c + size))
        v = torch.cat([proj(context, "self_attn.v_proj"), proj(y, "self_attn.v_proj")]).view(-1, kv_heads, d)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=visible, enable_gqa=True
        )
        x = x + proj(out.transpose(0, 1).reshape(size, heads * d), "self_attn.o_proj")
        y = norm(x, p + "post_attention_layernorm.weight")
        x = x + proj(F.silu(proj(y, "mlp.gate_proj")) * proj(y, "mlp.up_proj"), "mlp.down_proj")
    logits = norm(x, "norm.weight")[1:] @ tensors["lm_head.weight"].T
    columns = logits.argmax(-1)
    return columns + tensors["d2t"][columns]


@pytest.mark.parametrize("drafter", ["jetflow", "dflash"])
def test_vllms_computation_on_the_export_drafts_what_the_head_drafts(tiny_llama, tmp_path, drafter) -> None:
    make_checkpoint(tiny_llama, tmp_path / "ckpt", drafter=drafter, seed=3)
    cls = default_registry().get("drafter", drafter)
    loaded = cls(cls.Params(checkpoint=str(tmp_path / "ckpt")), tiny_llama)
    export = build_export(drafter, tiny_llama, "tiny", params={"checkpoint": str(tmp_path / "ckpt")})
    assert export.config.causal == (drafter == "jetflow")
    torch.manual_seed(1)
    features = torch.randn(9, len(loaded.head.config.feature_layers), 64)
    shared = FrozenTargetParts.from_target(tiny_llama)
    anchor = 17
    with torch.no_grad():
        hidden = loaded.head.draft(
            loaded.head.extend(loaded.head.empty_cache(), features), shared.embed(torch.tensor(anchor))
        )
        expected = loaded.lm.token_ids(loaded.lm.logits(hidden).argmax(-1))
        mask_id = export.config.mask_token_id

        def embed(ids):  # vLLM swaps in mask_embedding.pt wherever the input is the mask token
            rows = shared.embed(ids)
            return torch.where((ids == mask_id)[:, None], export.mask_embedding, rows)

        got = _vllm_dflash_draft(export.tensors, export.config, embed, features, anchor, mask_id)
    assert torch.equal(got, expected)


def test_a_written_folder_reads_back_and_is_checked(exported, tmp_path) -> None:
    _, export = exported
    folder = write_export(export, tmp_path / "out")
    config, tensors, mask = read_export(folder)
    assert config == export.config and torch.equal(mask, export.mask_embedding)
    assert all(torch.equal(tensors[name], export.tensors[name]) for name in export.tensors)
    write_export(export, folder)  # an earlier export is replaced
    stray = tmp_path / "not-an-export"
    stray.mkdir()
    with pytest.raises(ConfigError, match="not an export folder"):
        write_export(export, stray)
    raw = json.loads((folder / CONFIG_JSON).read_text())
    raw["transformer_layer_config"]["num_hidden_layers"] = 3  # now the weights miss a layer
    (folder / CONFIG_JSON).write_text(json.dumps(raw))
    with pytest.raises(DataError, match="missing"):
        read_export(folder)


def test_a_failed_write_keeps_the_earlier_export_whole(exported, tmp_path, monkeypatch) -> None:
    _, export = exported
    folder = write_export(export, tmp_path / "out")

    def disk_full(*args, **kwargs) -> None:
        raise OSError("no space left on device")

    monkeypatch.setattr("jetflow.export.folder.save_file", disk_full)
    with pytest.raises(OSError, match="no space"):
        write_export(export, folder)
    config, _, _ = read_export(folder)
    assert config == export.config
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "out"], "no staging folder left"


def test_the_head_is_read_from_its_checkpoint_without_building_a_drafter(
    tiny_llama, tmp_path, monkeypatch
) -> None:
    make_checkpoint(tiny_llama, tmp_path / "ckpt")

    def no_runtime_drafter(*args, **kwargs) -> None:
        raise AssertionError("the exporter built a runtime drafter (target parts, packed weights)")

    monkeypatch.setattr(LearnedDrafter, "__init__", no_runtime_drafter)
    export = build_export("jetflow", tiny_llama, "tiny", params={"checkpoint": str(tmp_path / "ckpt")})
    assert export.config.jetflow["checkpoint"] == str(tmp_path / "ckpt")
    with pytest.raises(ConfigError, match="no trained head to export"):
        build_export("ngram", tiny_llama, "tiny")


def test_a_bidirectional_export_must_draft_its_whole_block(exported) -> None:
    _, export = exported
    raw = json.loads(export.config.model_dump_json()) | {"sliding_window_non_causal": True}
    raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = 2
    with pytest.raises(ValueError, match="block_size - 1"):
        DFlashConfig.model_validate(raw)


def test_vllm_drafts_a_causal_block_as_far_as_the_budget_a_bidirectional_one_whole(exported) -> None:
    _, export = exported  # a causal block of 4: 3 mask slots
    assert chain_lengths(export.config, [1, 2, 16, "auto"]) == [1, 2, 3]  # the block bounds a chain
    assert chain_lengths(export.config, ["auto"]) == [3]  # what the folder says
    raw = json.loads(export.config.model_dump_json()) | {"sliding_window_non_causal": True}
    bidirectional = DFlashConfig.model_validate(raw)
    assert chain_lengths(bidirectional, [1, 2, 16]) == [3]  # every slot sees every other: all or none


def test_the_shipped_heads_layouts_are_refused_with_what_differs(tiny_llama, tmp_path) -> None:
    make_checkpoint(tiny_llama, tmp_path / "anchored", anchored_slots=True)
    with pytest.raises(NotExportableError, match="anchored_slots"):
        build_export("jetflow", tiny_llama, params={"checkpoint": str(tmp_path / "anchored")})
    torch.manual_seed(0)
    eagle = default_registry().get("drafter", "eagle").new_head(tiny_llama, {"draft_vocab_size": 40})
    info = CheckpointInfo(
        "eagle", eagle.config.model_dump(), target_record(tiny_llama, eagle.config.feature_layers)
    )
    save_checkpoint(tmp_path / "eagle", eagle, info)
    with pytest.raises(NotExportableError, match="in_proj"):
        build_export("eagle", tiny_llama, params={"checkpoint": str(tmp_path / "eagle")})
    assert dflash_differences({"qk_norm": False, "hidden_size": 8})[0].startswith("qk_norm=false")
    assert "no counterpart" in dflash_differences({"new_gate": True})[0]  # a field grown later is not ignored


def test_the_mask_token_is_an_unused_special_token(tiny_llama) -> None:
    assert choose_mask_token(tiny_llama, avoid=[]) == 0  # <pad>: not <eos> (1), which the target emits
    assert choose_mask_token(tiny_llama, avoid=[0]) == 0  # no other special token: still not <eos>


def test_cli_exports_a_head_for_a_target_folder(tiny_llama, tmp_path, capsys) -> None:
    folder = tmp_path / "target"
    tiny_llama.model.save_pretrained(folder)
    tiny_llama.tokenizer.save_pretrained(folder)
    make_checkpoint(tiny_llama, tmp_path / "ckpt")
    out = tmp_path / "out"
    args = ["export", "--drafter", "jetflow", "--checkpoint", str(tmp_path / "ckpt"), "--target", str(folder)]
    assert main([*args, "--out", str(out)]) == 0
    assert f"vllm serve {out}" in capsys.readouterr().out
    config, _, _ = read_export(out)
    assert config.speculators_config.verifier.name_or_path == str(folder.resolve())
    assert main(["export", "--drafter", "ngram", "--target", str(folder), "--out", str(tmp_path / "x")]) == 2
