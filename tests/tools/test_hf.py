"""`dist-ckpt export-hf` / `import-hf` on GPTModel-shaped checkpoints written by our `save`
(single process): round trips and refusals. The same against megatron-core's GPTModel and
transformers: tests/interop/test_huggingface.py."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Dict

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing.cli import main

L, H, HEADS, GROUPS, D, F, V, E = 2, 32, 4, 2, 8, 48, 96, 4
CONFIG = '{"num_attention_heads": 4, "rotary_base": 1000000, "layernorm_epsilon": 1e-6}'


def _gpt(moe: bool, tied: bool, extra: tuple = ()) -> Dict[str, torch.Tensor]:
    """Global tensors as megatron-core 0.16 stores a GPTModel (layer-stacked keys)."""
    g = torch.Generator().manual_seed(0)
    shapes = {
        "embedding.word_embeddings.weight": (V, H),
        "decoder.final_layernorm.weight": (H,),
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (L, H),
        "decoder.layers.self_attention.linear_qkv.weight": (L, (HEADS + 2 * GROUPS) * D, H),
        "decoder.layers.self_attention.linear_proj.weight": (L, H, HEADS * D),
        "decoder.layers.mlp.linear_fc1.layer_norm_weight": (L, H),
        **({} if tied else {"output_layer.weight": (V, H)}),
        **dict.fromkeys(extra, (L, H)),
    }
    if moe:
        shapes["decoder.layers.mlp.router.weight"] = (L, E, H)
        shapes["decoder.layers.mlp.experts.experts.linear_fc1.weight"] = (L, E, 2 * F, H)
        shapes["decoder.layers.mlp.experts.experts.linear_fc2.weight"] = (L, E, H, F)
    else:
        shapes["decoder.layers.mlp.linear_fc1.weight"] = (L, 2 * F, H)
        shapes["decoder.layers.mlp.linear_fc2.weight"] = (L, H, F)
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def _save(tensors: Dict[str, torch.Tensor], path: Path) -> Path:
    dc.save({k: dc.ShardedTensor.from_rank_offsets(k, t) for k, t in tensors.items()}, path)
    return path


@pytest.mark.parametrize("moe,tied", [(False, True), (True, False)])
def test_export_then_import_gives_back_every_tensor_bit_exactly(tmp_path, moe, tied):
    tensors = _gpt(moe, tied)
    ckpt = _save(tensors, tmp_path / "mc")
    assert main(["export-hf", str(ckpt), str(tmp_path / "hf"), "--config", CONFIG]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == ("mixtral" if moe else "llama")
    want = dict(num_key_value_heads=GROUPS, head_dim=D, num_hidden_layers=L, vocab_size=V)
    assert {k: config[k] for k in want} == want
    assert config["tie_word_embeddings"] is tied and config["rope_theta"] == 1e6
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    per_layer = 9 if not moe else 7 + 3 * E  # q k v o, 2 norms, gate up down | router
    assert len(index["weight_map"]) == 2 + (not tied) + L * per_layer
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "back"), "--tp", "2"]) == 0
    back = dc.load_plain_tensors(tmp_path / "back")
    assert back.keys() == tensors.keys()
    assert all(torch.equal(back[k], t) for k, t in tensors.items())
    # what import stored describes it: a second export needs no --config and is the same
    assert main(["export-hf", str(tmp_path / "back"), str(tmp_path / "hf2")]) == 0
    assert json.loads((tmp_path / "hf2" / "config.json").read_text()) == config


def test_export_refuses_a_stored_description_whose_bytes_are_damaged(tmp_path, capsys):
    """The model description `import-hf` stored is checked against its checksum like every
    other item an export reads: a flipped byte is named, never turned into a config."""
    ckpt = _save(_gpt(False, True), tmp_path / "mc")
    assert main(["export-hf", str(ckpt), str(tmp_path / "hf"), "--config", CONFIG]) == 0
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    (data,) = [f for f in (tmp_path / "back").glob("*.distcp") if b"rotary_base" in f.read_bytes()]
    raw = bytearray(data.read_bytes())
    raw[raw.index(b"rotary_base")] ^= 0x01
    data.write_bytes(bytes(raw))
    capsys.readouterr()
    assert main(["export-hf", str(tmp_path / "back"), str(tmp_path / "hf2")]) != 0
    assert "checksum" in capsys.readouterr().err


def test_export_refuses_names_it_cannot_map_and_lists_all_of_them(tmp_path, capsys):
    extra = ("vision_tower.proj.weight", "decoder.layers.self_attention.q_layernorm.weight")
    ckpt = _save(_gpt(False, True, extra), tmp_path / "mc")
    assert main(["export-hf", str(ckpt), str(tmp_path / "hf"), "--config", CONFIG]) == 2
    err = capsys.readouterr().err
    assert all(name in err for name in extra) and "2 stored tensor(s)" in err
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(
    "config,needle",
    [
        ('{"num_attention_heads": 4, "normalization": "LayerNorm"}', "normalization"),
        ('{"num_attention_heads": 4, "rotary_interleaved": true}', "rotary_interleaved"),
        ('{"rotary_base": 10000}', "num_attention_heads"),
    ],
)
def test_export_refuses_a_model_that_is_not_llama_like(tmp_path, capsys, config, needle):
    ckpt = _save(_gpt(False, True), tmp_path / "mc")
    assert main(["export-hf", str(ckpt), str(tmp_path / "hf"), "--config", config]) == 2
    assert needle in capsys.readouterr().err


def test_export_without_a_description_says_how_to_give_one(tmp_path, capsys):
    ckpt = _save(_gpt(False, True), tmp_path / "mc")
    assert main(["export-hf", str(ckpt), str(tmp_path / "hf")]) == 2
    assert "no model description" in capsys.readouterr().err


@pytest.fixture
def hf_dir(tmp_path: Path) -> Path:
    ckpt = _save(_gpt(False, False), tmp_path / "mc")
    assert main(["export-hf", str(ckpt), str(tmp_path / "hf"), "--config", CONFIG]) == 0
    return tmp_path / "hf"


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"model_type": "gpt2"}, "model_type='gpt2'"),
        ({"rope_scaling": {"rope_type": "llama3"}}, "rope_scaling"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_import_refuses_other_architectures(hf_dir, tmp_path, capsys, change, needle):
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, **change}))
    assert main(["import-hf", str(hf_dir), str(tmp_path / "out")]) == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_import_refuses_tensors_it_cannot_map(hf_dir, tmp_path, capsys):
    header = {"model.vision.patch.weight": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    raw = json.dumps(header).encode()
    (hf_dir / "extra.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(8))
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.vision.patch.weight"] = "extra.safetensors"
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    assert main(["import-hf", str(hf_dir), str(tmp_path / "out")]) == 2
    assert "model.vision.patch.weight" in capsys.readouterr().err


def test_import_refuses_a_split_the_sizes_do_not_divide(hf_dir, tmp_path, capsys):
    assert main(["import-hf", str(hf_dir), str(tmp_path / "out"), "--tp", "3", "--pp", "4"]) == 2
    err = capsys.readouterr().err
    assert "num_attention_heads=4 is not divisible by 3" in err
    assert "num_hidden_layers=2 is not divisible by 4" in err
