"""`hf_model.load` / `save` in one process without transformers: a stand-in model with
transformers' parameter names and a config with its fields (the side venv tests the real
thing, tests/interop/test_hf_model.py)."""

from __future__ import annotations

import argparse
from typing import Any, Dict

import pytest
import torch
from torch import nn

import dist_checkpointing as dc
from dist_checkpointing import hf_model
from dist_checkpointing.errors import CheckpointingException, LossyDtypeConversionError
from dist_checkpointing.tools import hf_map

LAYERS, HIDDEN, HEADS, GROUPS, D, FFN, VOCAB = 2, 8, 4, 2, 2, 12, 10


class _Config:
    def __init__(self, **fields: Any) -> None:
        self.fields = fields

    def to_dict(self) -> Dict[str, Any]:
        return dict(self.fields)


def _model(seed: int, tied: bool = False, experts: int = 0, **changes: Any) -> nn.Module:
    """A module whose parameters carry a Llama's (with `experts`: transformers 5 Mixtral's)
    names and shapes."""
    fields: Dict[str, Any] = dict(
        model_type="llama",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=GROUPS,
        head_dim=D,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=tied,
    )
    if experts:
        fields.update(model_type="mixtral", num_local_experts=experts, num_experts_per_tok=2)
    fields.update(changes)
    h, g, d = fields["num_attention_heads"], fields["num_key_value_heads"], fields["head_dim"]
    ffn = fields["intermediate_size"]
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,)}
    if not tied:
        shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    for i in range(LAYERS):
        pre = f"model.layers.{i}."
        shapes[pre + "input_layernorm.weight"] = (HIDDEN,)
        shapes[pre + "post_attention_layernorm.weight"] = (HIDDEN,)
        shapes[pre + "self_attn.q_proj.weight"] = (h * d, HIDDEN)
        shapes[pre + "self_attn.k_proj.weight"] = (g * d, HIDDEN)
        shapes[pre + "self_attn.v_proj.weight"] = (g * d, HIDDEN)
        shapes[pre + "self_attn.o_proj.weight"] = (HIDDEN, h * d)
        if experts:
            shapes[pre + "mlp.gate.weight"] = (experts, HIDDEN)
            shapes[pre + "mlp.experts.gate_up_proj"] = (experts, 2 * ffn, HIDDEN)
            shapes[pre + "mlp.experts.down_proj"] = (experts, HIDDEN, ffn)
        else:
            shapes[pre + "mlp.gate_proj.weight"] = (ffn, HIDDEN)
            shapes[pre + "mlp.up_proj.weight"] = (ffn, HIDDEN)
            shapes[pre + "mlp.down_proj.weight"] = (HIDDEN, ffn)
    root = nn.Module()
    gen = torch.Generator().manual_seed(seed)
    for name, shape in shapes.items():
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, nn.Module())
            m = getattr(m, part)
        m.register_parameter(leaf, nn.Parameter(torch.randn(shape, generator=gen)))
    root.config = _Config(**fields)  # type: ignore[assignment]
    return root


def _stepped(model: nn.Module) -> torch.optim.Adam:
    adam = torch.optim.Adam(model.parameters(), lr=0.1)
    sum(
        (p * torch.linspace(-1, 1, p.numel()).view_as(p)).sum() for p in model.parameters()
    ).backward()
    adam.step()
    return adam


def test_save_then_load_gives_back_model_and_adam_state_bit_exactly(tmp_path):
    model = _model(1)
    adam = _stepped(model)
    hf_model.save(model, tmp_path / "mc", adam, common_state={"iteration": 3})
    # stored as megatron fuses them: [q; k; v] per query group, fc1 = [gate; up]
    stored = dc.load_plain_tensors(tmp_path / "mc")
    layer = model.get_submodule("model.layers.1")
    qkv = [
        layer.self_attn.q_proj.weight,
        layer.self_attn.k_proj.weight,
        layer.self_attn.v_proj.weight,
    ]
    fused = hf_map.fuse("linear_qkv.weight", qkv, HEADS, GROUPS)
    assert torch.equal(stored["decoder.layers.self_attention.linear_qkv.weight"][1], fused)
    gate_up = torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight])
    assert torch.equal(stored["decoder.layers.mlp.linear_fc1.weight"][1], gate_up)

    other = _model(2)
    other_adam = torch.optim.Adam(other.parameters(), lr=0.1)
    common = hf_model.load(other, tmp_path / "mc", other_adam)
    assert common["iteration"] == 3
    for (name, p), q in zip(model.named_parameters(), other.parameters()):
        assert torch.equal(p, q), name
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(adam.state[p][key], other_adam.state[q][key]), (name, key)


@pytest.mark.parametrize("tied,experts", [(True, 0), (False, 3)])
def test_save_then_load_round_trips_tied_and_mixture_of_experts_models(tmp_path, tied, experts):
    model = _model(1, tied=tied, experts=experts)
    adam = _stepped(model)
    hf_model.save(model, tmp_path / "mc", adam)
    stored = dc.load_tensors_metadata(tmp_path / "mc")
    assert ("output_layer.weight" in stored) is not tied
    if experts:  # megatron's layer-stacked expert keys: layer axis, then expert axis
        key = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
        assert stored[key].global_shape == (LAYERS, experts, 2 * FFN, HIDDEN)
    other = _model(2, tied=tied, experts=experts)
    other_adam = torch.optim.Adam(other.parameters(), lr=0.1)
    hf_model.load(other, tmp_path / "mc", other_adam)
    for (name, p), q in zip(model.named_parameters(), other.parameters()):
        assert torch.equal(p, q), name
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(adam.state[p][key], other_adam.state[q][key]), (name, key)


@pytest.fixture
def saved(tmp_path):
    hf_model.save(_model(1), tmp_path / "mc")
    return tmp_path / "mc"


def _refused(model: nn.Module, ckpt: Any, optimizer: Any = None) -> str:
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(CheckpointingException) as e:
        hf_model.load(model, ckpt, optimizer)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return str(e.value)


def test_load_refuses_a_shape_that_does_not_fit_naming_parameter_shapes_and_field(saved):
    msg = _refused(_model(2, intermediate_size=FFN + 2), saved)
    assert "model.layers.0.mlp.gate_proj.weight" in msg and "intermediate_size" in msg
    assert f"({FFN + 2}, {HIDDEN})" in msg and f"({FFN}, {HIDDEN})" in msg


def test_load_refuses_parameters_without_a_source_listing_all(saved):
    model = _model(2)
    model.get_submodule("model.layers.0").self_attn.q_proj.register_parameter(
        "bias", nn.Parameter(torch.zeros(8))
    )
    model.get_submodule("model.layers.1").self_attn.k_proj.register_parameter(
        "bias", nn.Parameter(torch.zeros(4))
    )
    msg = _refused(model, saved)
    assert "2 parameter(s)" in msg
    assert "layers.0.self_attn.q_proj.bias" in msg and "layers.1.self_attn.k_proj.bias" in msg


def test_load_refuses_a_tied_model_for_an_untied_checkpoint(saved):
    assert "tie_word_embeddings" in _refused(_model(2, tied=True), saved)


def test_load_refuses_another_architecture(saved):
    assert "model_type='gpt2'" in _refused(_model(2, model_type="gpt2"), saved)


def test_load_refuses_an_optimizer_the_checkpoint_has_no_state_for(saved):
    model = _model(2)
    adam = torch.optim.Adam(model.parameters())
    msg = _refused(model, saved, adam)
    assert "lacks 18 optimizer state tensor(s)" in msg and "optimizer.state.exp_avg." in msg
    assert not adam.state


def test_load_refuses_a_description_that_contradicts_the_config(tmp_path):
    hf_model.save(_model(1), tmp_path / "mc")  # the description says rope_theta 10000
    assert "rope_theta" in _refused(_model(2, rope_theta=500000.0), tmp_path / "mc")


def test_save_refuses_an_optimizer_without_state(tmp_path):
    model = _model(1)
    with pytest.raises(CheckpointingException, match="no Adam state"):
        hf_model.save(model, tmp_path / "mc", torch.optim.Adam(model.parameters()))


@pytest.mark.parametrize("experts,ep", [(0, 1), (4, 1), (4, 2)])
def test_save_writes_megatrons_default_param_groups_from_a_single_group_adamw(
    tmp_path, experts, ep
):
    model = _model(1, experts=experts)
    adam = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.05)
    sum(p.sum() for p in model.parameters()).backward()
    adam.step()
    hf_model.save(model, tmp_path / "mc", adam, ep=ep)
    groups = dc.load_common_state_dict(tmp_path / "mc")["optimizer"]["param_groups"]
    fields = [(g["wd_mult"], g["is_expert_parallel"]) for g in groups]
    # decayed weights, experts apart only when expert-parallel, then norms without decay
    assert fields == [(1.0, False)] + [(1.0, True)] * (ep > 1) + [(0.0, False)]
    for g in groups:
        assert (g["lr"], g["weight_decay"], g["max_lr"]) == (0.1, 0.05, 0.1)
        assert (g["lr_mult"], g["is_decoupled_lr"]) == (1.0, False)


def test_save_refuses_torch_groups_that_differ_within_one_megatron_group(tmp_path):
    model = _model(1)
    embed = model.get_parameter("model.embed_tokens.weight")
    norm = model.get_parameter("model.norm.weight")
    rest = [p for p in model.parameters() if p is not embed and p is not norm]
    adam = torch.optim.Adam([{"params": [embed], "lr": 0.5}, {"params": rest + [norm]}], lr=0.1)
    sum(p.sum() for p in model.parameters()).backward()
    adam.step()
    with pytest.raises(CheckpointingException, match="embed_tokens.*'lr' \\(0.5 and 0.1\\)"):
        hf_model.save(model, tmp_path / "mc", adam)
    wd_mult = torch.optim.Adam([{"params": [norm], "wd_mult": 1.0}, {"params": rest + [embed]}])
    wd_mult.state.update(adam.state)
    with pytest.raises(CheckpointingException, match="model.norm.weight.*wd_mult=1.0"):
        hf_model.save(model, tmp_path / "mc2", wd_mult)


def test_load_reads_the_description_from_megatron_lm_args(saved, tmp_path):
    # as Megatron-LM writes it: global tensors and its arguments in the common state
    tensors = dc.load_plain_tensors(saved)
    sd: Dict[str, Any] = {k: dc.ShardedTensor.from_rank_offsets(k, t) for k, t in tensors.items()}
    sd["args"] = argparse.Namespace(
        num_attention_heads=HEADS, normalization="RMSNorm", rotary_base=500000.0
    )
    dc.save(sd, tmp_path / "lm")
    assert "rope_theta: model 10000.0, checkpoint 500000.0" in _refused(_model(2), tmp_path / "lm")
    model = _model(2, rope_theta=500000.0)
    assert hf_model.load(model, tmp_path / "lm")["args"].rotary_base == 500000.0
    for name, p in model.named_parameters():
        assert torch.equal(p, _model(1).get_parameter(name)), name


def test_load_into_a_narrower_dtype_rounds_only_when_allowed(saved):
    model = _model(2).to(torch.bfloat16)
    with pytest.raises(LossyDtypeConversionError, match="weight"):
        hf_model.load(model, saved)
    hf_model.load(model, saved, allow_lossy_dtype_conversion=True)
    for name, p in model.named_parameters():
        assert torch.equal(p, _model(1).get_parameter(name).to(torch.bfloat16)), name
