"""The Eagle3 export of an EAGLE head: config and tensors against the format, vLLM's forward
recomputed from the written tensors against the head's drafts, and refusals."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from jetflow.bench.vllm_methods import chain_lengths
from jetflow.cli.main import main
from jetflow.core.errors import DataError
from jetflow.core.tree import DraftTree
from jetflow.drafters.blocks import FrozenTargetParts
from jetflow.drafters.eagle.head import EAGLE3_OPTIONS
from jetflow.drafters.eagle.plugin import EagleDrafter, EagleParams, EagleSession
from jetflow.export.compat import NotExportableError, eagle3_differences
from jetflow.export.exporter import build_export
from jetflow.export.folder import read_export, write_export
from jetflow.export.schema import CONFIG_JSON, MASK_EMBEDDING, Eagle3Config

from tests.conftest import make_tiny_target
from tests.export.test_speculators import make_checkpoint

EAGLE3 = {"layout": "eagle3", "feature_layers": (1, 2, 3), "ttt_steps": 3, "draft_vocab_size": 40}


def eagle3_checkpoint(target, folder, seed=0, **options):
    return make_checkpoint(target, folder, drafter="eagle", seed=seed, base=EAGLE3, **options)


@pytest.fixture
def exported(tiny_llama, tmp_path):
    head = eagle3_checkpoint(tiny_llama, tmp_path / "ckpt")
    export = build_export("eagle", tiny_llama, "tiny", params={"checkpoint": str(tmp_path / "ckpt")})
    return head, export


def test_config_matches_the_head_and_the_format(exported) -> None:
    head, export = exported
    raw = json.loads(export.config.model_dump_json())
    config = Eagle3Config.model_validate(raw)
    layer = config.transformer_layer_config
    assert config.speculators_model_type == "eagle3" and config.speculators_config.algorithm == "eagle3"
    assert layer.model_type == "llama" and layer.num_hidden_layers == 1  # a Llama target: no q/k norms
    assert (layer.hidden_size, layer.head_dim, layer.num_key_value_heads, layer.vocab_size) == (
        64,
        16,
        2,
        256,
    )
    assert layer.rope_parameters["rope_theta"] == head.config.rope_theta
    # vLLM's aux layer k is the output of decoder layer k (hidden_states[k]), jetflow's numbering
    assert config.eagle_aux_hidden_state_layer_ids == (1, 2, 3)
    assert (
        config.speculative_tokens == 3 and config.draft_vocab_size == 40 and config.target_hidden_size == 64
    )
    assert {name: raw[name] for name in EAGLE3_OPTIONS} == EAGLE3_OPTIONS  # written, not left to defaults
    assert config.speculators_config.verifier.architectures == ("LlamaForCausalLM",)


def test_every_head_tensor_lands_once_under_vllms_name(exported, tiny_llama) -> None:
    head, export = exported
    tensors, state = export.tensors, head.state_dict()
    assert set(tensors) == set(export.config.expected_tensors())
    assert not any("embed_tokens" in name for name in tensors)  # vLLM shares the target's embedding
    pairs = {
        "fc.weight": "fusion.proj.weight",
        "layers.0.input_layernorm.weight": "embed_norm.weight",
        "layers.0.hidden_norm.weight": "layer.hidden_norm.weight",
        "layers.0.self_attn.q_proj.weight": "layer.attn.q_proj.weight",
        "layers.0.post_attention_layernorm.weight": "layer.post_norm.weight",
        "layers.0.mlp.up_proj.weight": "layer.mlp.up_proj.weight",
        "norm.weight": "norm.weight",
    }
    for name, source in pairs.items():
        assert torch.equal(tensors[name], state[source]), name
    used = sum(t.numel() for n, t in tensors.items() if n not in {"lm_head.weight", "d2t", "t2d"})
    assert used == sum(t.numel() for n, t in state.items() if n != "draft_tokens")  # nothing dropped
    lm = tiny_llama.model.get_output_embeddings().weight
    assert torch.equal(tensors["lm_head.weight"], lm[head.draft_tokens])
    assert torch.equal(torch.arange(40) + tensors["d2t"], head.draft_tokens)  # target id = i + d2t[i]


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style rotary embedding of ``x [n, heads, d]`` at ``positions [n]`` (vLLM's Llama/Qwen3)."""
    d = x.shape[-1]
    angles = positions[:, None].float() / theta ** (torch.arange(0, d, 2).float() / d)
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]
    return x * cos + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1) * sin


def _vllm_eagle3_chain(tensors, config, embed, features, tokens, steps):
    """What vLLM's Eagle3 model and proposer compute (llama_eagle3.py / qwen3_eagle3.py and the
    eagle proposer, read, restated in torch): ``fc`` over the aux states; a first pass over the
    context entries (the token after each feature, at the feature's position); then one entry
    per drafted token paired with the previous step's state. Per step: ``(log-probs over the
    draft vocabulary, target id drafted)``."""
    layer, p = config.transformer_layer_config, "layers.0."
    eps, d, theta = layer.rms_norm_eps, layer.head_dim, layer.rope_parameters["rope_theta"]
    heads, kv_heads = layer.num_attention_heads, layer.num_key_value_heads
    assert not config.norm_before_fc and not config.fc_norm

    def norm(x, name):
        return F.rms_norm(x, (x.shape[-1],), tensors[name], eps)

    def lin(x, name):
        return x @ tensors[name].T

    cache = {"k": torch.zeros(0, kv_heads, d), "v": torch.zeros(0, kv_heads, d), "pos": torch.zeros(0)}

    def forward(ids, states, positions):
        embeds, hidden = (
            norm(embed(ids), p + "input_layernorm.weight"),
            norm(states, p + "hidden_norm.weight"),
        )
        residual = hidden if config.norm_before_residual else states
        x = torch.cat([embeds, hidden], -1)
        n = x.shape[0]
        q = lin(x, p + "self_attn.q_proj.weight").view(n, heads, d)
        k = lin(x, p + "self_attn.k_proj.weight").view(n, kv_heads, d)
        v = lin(x, p + "self_attn.v_proj.weight").view(n, kv_heads, d)
        if layer.model_type == "qwen3":
            q, k = norm(q, p + "self_attn.q_norm.weight"), norm(k, p + "self_attn.k_norm.weight")
        q, k = _rope(q, positions, theta), _rope(k, positions, theta)
        cache.update(k=torch.cat([cache["k"], k]), v=torch.cat([cache["v"], v]))
        cache["pos"] = torch.cat([cache["pos"], positions.float()])
        visible = cache["pos"][None] <= positions[:, None]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            cache["k"].transpose(0, 1),
            cache["v"].transpose(0, 1),
            attn_mask=visible,
            enable_gqa=True,
        )
        h = residual + lin(out.transpose(0, 1).reshape(n, heads * d), p + "self_attn.o_proj.weight")
        y = norm(h, p + "post_attention_layernorm.weight")
        h = h + lin(
            F.silu(lin(y, p + "mlp.gate_proj.weight")) * lin(y, p + "mlp.up_proj.weight"),
            p + "mlp.down_proj.weight",
        )
        normed = norm(h, "norm.weight")
        return normed[-1:], (normed if config.norm_output else h)[-1:]

    c = features.shape[0]
    normed, state = forward(tokens[1:], lin(features.flatten(1), "fc.weight"), torch.arange(c))
    drafted = []
    for step in range(steps):
        logprobs = torch.log_softmax(normed[0] @ tensors["lm_head.weight"].T, -1)
        column = logprobs.argmax()
        drafted.append((logprobs, int(column + tensors["d2t"][column])))
        if step + 1 < steps:
            normed, state = forward(torch.tensor([drafted[-1][1]]), state, torch.tensor([c + step]))
    return drafted


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_vllms_computation_on_the_export_drafts_what_the_head_drafts(
    tiny_llama, tmp_path, architecture
) -> None:
    """vLLM's Eagle3 math on the written tensors gives the head's distributions at every depth
    of a chain (the depth-1 query over the context, then states fed back twice)."""
    target = tiny_llama if architecture == "llama" else make_tiny_target("qwen3")
    eagle3_checkpoint(target, tmp_path / "ckpt", seed=5)
    drafter = EagleDrafter(EagleParams(checkpoint=str(tmp_path / "ckpt")), target)
    head = drafter.head
    assert head.config.qk_norm == (architecture == "qwen3")  # the target family's layer
    export = build_export("eagle", target, "tiny", params={"checkpoint": str(tmp_path / "ckpt")})
    assert export.config.transformer_layer_config.model_type == architecture
    shared = FrozenTargetParts.from_target(target)
    torch.manual_seed(2)
    features = torch.randn(9, 3, 64)
    tokens = torch.randint(2, 256, (10,))
    with torch.no_grad():
        expected = _vllm_eagle3_chain(export.tensors, export.config, shared.embed, features, tokens, steps=3)
        cache = head.extend(head.empty_cache(), features, shared.embed(tokens[1:]))
        session = EagleSession(head, drafter.lm, shared, cache, None)
        tree, node = DraftTree.root(int(tokens[-1])), torch.tensor([0])
        for logprobs, token in expected:
            ids, got = session.children(tree, node, 40)
            by_column = torch.empty(40).index_copy_(0, drafter.lm.columns(ids[0], 256), got[0])
            torch.testing.assert_close(by_column, logprobs, atol=2e-5, rtol=1e-4)
            assert int(ids[0, 0]) == token
            tree = tree.extend(node, torch.tensor([token]), torch.zeros(1))
            node = torch.tensor([tree.size - 1])


def test_vllm_drafts_an_eagle3_chain_as_long_as_each_budget(exported) -> None:
    _, export = exported  # trained 3 steps deep, drafted one step at a time like jetflow's chain
    assert chain_lengths(export.config, [2, 4, 8, 0]) == [2, 4, 8]
    assert chain_lengths(export.config, ["auto"]) == [3]


def test_a_written_folder_reads_back_without_a_mask_embedding(exported, tmp_path) -> None:
    _, export = exported
    folder = write_export(export, tmp_path / "out")
    config, tensors, mask = read_export(folder)
    assert config == export.config and mask is None and not (folder / MASK_EMBEDDING).exists()
    assert all(torch.equal(tensors[name], export.tensors[name]) for name in export.tensors)
    raw = json.loads((folder / CONFIG_JSON).read_text())
    del raw["norm_before_residual"]  # vLLM would assume true: a folder must say it
    (folder / CONFIG_JSON).write_text(json.dumps(raw))
    with pytest.raises(DataError, match="norm_before_residual"):
        read_export(folder)
    raw["norm_before_residual"] = True
    raw["eagle_aux_hidden_state_layer_ids"] = [3, 1, 2]
    (folder / CONFIG_JSON).write_text(json.dumps(raw))
    with pytest.raises(DataError, match="increasing layer order"):
        read_export(folder)


def test_the_jetflow_layout_and_unknown_fields_are_refused_with_what_differs(tiny_llama, tmp_path) -> None:
    eagle3_checkpoint(tiny_llama, tmp_path / "jetflow", layout="jetflow")
    with pytest.raises(NotExportableError, match=r"layout=jetflow: in_proj .* head\.layout=eagle3"):
        build_export("eagle", tiny_llama, params={"checkpoint": str(tmp_path / "jetflow")})
    assert len(eagle3_differences({"hidden_size": 8})) == 2  # a record from before the field: jetflow
    assert eagle3_differences({"layout": "eagle3", "ttt_steps": 7, "qk_norm": True}) == []
    assert "no counterpart" in eagle3_differences({"layout": "eagle3", "new_gate": True})[0]
    (last,) = eagle3_differences({"layout": "eagle3", "feature_layers": (1, 4)}, target_layers=4)
    assert "the target's last" in last
    eagle3_checkpoint(tiny_llama, tmp_path / "last", feature_layers=(1, 2, 4))
    with pytest.raises(NotExportableError, match="feature layer 4 is the target's last"):
        build_export("eagle", tiny_llama, params={"checkpoint": str(tmp_path / "last")})


def test_cli_exports_an_eagle3_head(tiny_llama, tmp_path, capsys) -> None:
    folder = tmp_path / "target"
    tiny_llama.model.save_pretrained(folder)
    tiny_llama.tokenizer.save_pretrained(folder)
    eagle3_checkpoint(tiny_llama, tmp_path / "ckpt")
    out = tmp_path / "out"
    args = ["export", "--drafter", "eagle", "--checkpoint", str(tmp_path / "ckpt"), "--target", str(folder)]
    assert main([*args, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "eagle3 (llama layer, 3 tokens per step)" in printed and f"vllm serve {out}" in printed
    assert read_export(out)[0].speculators_config.verifier.name_or_path == str(folder.resolve())
