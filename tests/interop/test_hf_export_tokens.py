"""`export-hf` carries what transformers users expect beside the weights: the special token
ids in `config.json` and a `generation_config.json` (single process, our own checkpoints)."""

from __future__ import annotations

import json

from dist_checkpointing.cli import main
from tests.tools.test_hf import _gpt, _save

CONFIG = {"num_attention_heads": 4, "rotary_base": 1000000, "layernorm_epsilon": 1e-6}


def test_export_writes_token_ids_given_in_the_description(tmp_path):
    ckpt = _save(_gpt(False, True), tmp_path / "mc")
    desc = json.dumps({**CONFIG, "bos_token_id": 5, "eos_token_id": 6})
    assert main(["export-hf", str(ckpt), str(tmp_path / "hf"), "--config", desc]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (5, 6)
    assert generation == {"bos_token_id": 5, "eos_token_id": 6}


def test_export_of_an_import_gives_back_token_ids_and_generation_config(tmp_path):
    ckpt = _save(_gpt(False, False), tmp_path / "mc")
    desc = json.dumps({**CONFIG, "bos_token_id": 1, "eos_token_id": 2})
    assert main(["export-hf", str(ckpt), str(tmp_path / "hf"), "--config", desc]) == 0
    # a model's own generation config, with settings megatron has no field for
    own = {"bos_token_id": 1, "eos_token_id": [2, 7], "do_sample": True, "temperature": 0.6}
    (tmp_path / "hf" / "generation_config.json").write_text(json.dumps(own))
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "mc2")]) == 0
    assert main(["export-hf", str(tmp_path / "mc2"), str(tmp_path / "hf2")]) == 0
    config = json.loads((tmp_path / "hf2" / "config.json").read_text())
    generation = json.loads((tmp_path / "hf2" / "generation_config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert generation == own


def test_export_without_known_token_ids_writes_none_and_guesses_nothing(tmp_path):
    ckpt = _save(_gpt(False, True), tmp_path / "mc")
    assert main(["export-hf", str(ckpt), str(tmp_path / "hf"), "--config", json.dumps(CONFIG)]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "bos_token_id" not in config and "eos_token_id" not in config
    assert not (tmp_path / "hf" / "generation_config.json").exists()
