"""transformers' side of the HuggingFace tests (one process, CPU, fp32).

Usage:
  python hf_side.py make WORKDIR    transformers builds small models from configs
      (`MODELS`), saves each with `save_pretrained` to `WORKDIR/<name>/hf` and writes its
      logits on the fixed input to `WORKDIR/<name>/logits.pt` (for `import-hf`).
  python hf_side.py check WORKDIR NAME...    `AutoModelForCausalLM.from_pretrained` loads
      each `WORKDIR/<NAME>/hf` (written by `export-hf`); its logits must match megatron's
      `WORKDIR/<NAME>/logits.pt` within 1e-4.

Writes `WORKDIR/hf_result.json`: `{check name: "ok" | failure}`.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Dict

from mcore_hf_side import tokens  # the same fixed input (this script's folder is on sys.path)

MODELS = {
    "imported": (
        "LlamaConfig",
        {"num_hidden_layers": 2, "tie_word_embeddings": False, "rope_theta": 20000.0},
    ),
    "imported_tied_moe": (
        "MixtralConfig",
        {"num_hidden_layers": 2, "tie_word_embeddings": True, "num_local_experts": 4},
    ),
}
COMMON = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
}


def main() -> None:
    import torch
    import transformers

    mode, workdir = sys.argv[1], sys.argv[2]
    results: Dict[str, str] = {}
    ids = tokens()
    if mode == "make":
        for name, (cls, extra) in MODELS.items():
            torch.manual_seed(5)
            config = getattr(transformers, cls)(**COMMON, **extra)
            model = transformers.AutoModelForCausalLM.from_config(config).eval()
            with torch.no_grad():  # norms start at 1: make them matter
                for pname, p in model.named_parameters():
                    if "norm" in pname:
                        p.copy_(1 + 0.1 * torch.randn(p.shape))
                logits = model(ids).logits
            model.save_pretrained(os.path.join(workdir, name, "hf"))
            torch.save(logits, os.path.join(workdir, name, "logits.pt"))
            results[f"{name}: made"] = "ok"
    else:
        for name in sys.argv[3:]:
            base = os.path.join(workdir, name)
            model = transformers.AutoModelForCausalLM.from_pretrained(
                os.path.join(base, "hf"), dtype=torch.float32
            ).eval()
            with torch.no_grad():
                logits = model(ids).logits
            want = torch.load(os.path.join(base, "logits.pt"))
            diff = float((logits - want).abs().max()) if logits.shape == want.shape else None
            results[f"{name}: transformers loads the export, logits match megatron's"] = (
                "ok" if diff is not None and diff <= 1e-4 else f"max abs difference {diff}"
            )
    with open(os.path.join(workdir, "hf_result.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
