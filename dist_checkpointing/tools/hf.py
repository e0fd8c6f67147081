"""`export_hf` / `import_hf`: megatron-core GPTModel checkpoints to and from HuggingFace
transformers' Llama / Mixtral layout (`dist-ckpt export-hf` / `import-hf`). Not collective.

A `torch_dist` checkpoint holds global tensors whatever tensor / pipeline / expert split
saved it, so neither direction needs a process group or the split it was saved with.
Export streams: one layer (one expert) of one tensor is read, split into its HF tensors and
written before the next is read. Names and layouts are `hf_map`'s tables.
"""

from __future__ import annotations

import json
import logging
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from ..errors import CheckpointExistsError, CheckpointingException
from . import _storage, hf_map
from ._info import PathArg
from .convert import (
    SAFETENSORS_DTYPES,
    SAFETENSORS_INDEX,
    ConvertResult,
    _source,
    parse_size,
    safetensors_header,
    tensor_bytes,
)

__all__ = ["export_hf", "import_hf", "DESCRIPTION_KEY"]

logger = logging.getLogger(__name__)

#: the ShardedObject in which `import_hf` stores the model's description (megatron's fields)
DESCRIPTION_KEY = "megatron_config"
_STACKED_EXPERTS, _ONE_EXPERT = hf_map.EXPERT_PREFIXES


@dataclass
class _Unit:
    """One stored region that becomes one or more HF tensors."""

    key: str
    index: Tuple[int, ...]  # leading (layer, expert) indices read from a stacked key
    name: str  # a GLOBAL key, a LAYER name or `experts.<EXPERT name>`
    hf: List[str]
    shape: Tuple[int, ...]
    dtype: torch.dtype


def _plan_export(entries: Dict[str, Any]) -> Tuple[List[_Unit], int]:
    """Units in key order, and the number of layers. Raises on any name not mapped."""
    moe = any(k.endswith("mlp.router.weight") for k in entries)
    units: List[_Unit] = []
    unmapped, skipped, layers = [], 0, set()
    for key, md in sorted(entries.items()):
        shape, dtype = tuple(int(s) for s in md.size), md.properties.dtype
        if key.startswith("optimizer."):  # optimizer state has no place in an HF model
            skipped += 1
            continue
        if key in hf_map.GLOBAL:
            units.append(_Unit(key, (), key, [hf_map.GLOBAL[key]], shape, dtype))
            continue
        parsed = hf_map.layer_name(key)
        layer, name = parsed if parsed else (None, "")
        expert: Optional[int] = -1  # -1: no expert; None: a stacked expert axis
        if name.startswith(_STACKED_EXPERTS):
            expert, name = None, name[len(_STACKED_EXPERTS) :]
        elif name.startswith(_ONE_EXPERT):
            e, _, name = name[len(_ONE_EXPERT) :].partition(".")
            expert = int(e) if e.isdigit() else -2
        table = hf_map.LAYER if expert == -1 else hf_map.EXPERT
        usable = moe or expert == -1
        if not parsed or name not in table or expert == -2 or not usable:
            unmapped.append(key)
            continue
        if moe and name in hf_map.DENSE_ONLY:
            unmapped.append(f"{key} (a dense MLP in a mixture-of-experts model)")
            continue
        lead = [range(shape[0])] if layer is None else []
        if expert is None:
            lead.append(range(shape[len(lead)]))
        for index in _product(lead):
            i = index[0] if layer is None else layer
            layers.add(i)
            base = f"model.layers.{i}."
            if expert != -1:
                base += f"block_sparse_moe.experts.{index[-1] if expert is None else expert}."
            full = name if expert == -1 else f"experts.{name}"
            sub = shape[len(index) :]
            units.append(_Unit(key, index, full, [base + n for n in table[name]], sub, dtype))
    if unmapped:
        raise CheckpointingException(
            f"{len(unmapped)} stored tensor(s) have no HuggingFace Llama / Mixtral name: "
            + ", ".join(unmapped)
        )
    if skipped:
        logger.info("not exported: %d optimizer tensors", skipped)
    return units, len(layers)


def _product(axes: List[range]) -> List[Tuple[int, ...]]:
    out: List[Tuple[int, ...]] = [()]
    for axis in axes:
        out = [(*o, i) for o in out for i in axis]
    return out


def _description(ckpt: Path, metadata: Any, config: Union[None, str, Dict[str, Any]]) -> Any:
    """The model's description: `config` (a dict, a JSON file or JSON text), else the one
    `import_hf` stored, else Megatron-LM's `args` in the common state."""
    if isinstance(config, dict):
        return config
    if config is not None:
        text = config if config.lstrip().startswith("{") else Path(config).read_text()
        try:
            return json.loads(text)
        except ValueError as e:
            raise CheckpointingException(f"config {config!r}: not JSON: {e}") from e
    if DESCRIPTION_KEY in {k.split("/")[0] for k in _storage.object_keys(metadata)}:
        return _storage.read_object(ckpt, metadata, f"{DESCRIPTION_KEY}/shard_0_1")
    why = ""
    if (ckpt / _storage.COMMON_FNAME).is_file():
        from ..serialization import load_common_state_dict

        try:
            args = load_common_state_dict(ckpt).get("args")
        except CheckpointingException as e:  # e.g. an argparse Namespace, not allowlisted
            args, why = None, f" (its common state: {e})"
        if args is not None:
            return args if isinstance(args, dict) else vars(args)
    raise CheckpointingException(
        f"{ckpt}: no model description stored{why}; give one "
        '(e.g. --config \'{"num_attention_heads": 32, "rotary_base": 500000}\', '
        "megatron's TransformerConfig field names)"
    )


def export_hf(
    ckpt: PathArg,
    out: PathArg,
    *,
    config: Union[None, str, Dict[str, Any]] = None,
    max_shard_size: Union[int, str] = "5GB",
) -> ConvertResult:
    """Writes a megatron-core GPTModel checkpoint as a HuggingFace Llama / Mixtral model.

    Steps: read the stored tensors' metadata; map every name (refusing any that has no HF
    name); derive `config.json` from the description and the shapes; then per safetensors
    file, read each stored layer / expert, split it into its HF tensors and write them.

    Args:
        ckpt: a `torch_dist` checkpoint of a GPTModel's sharded state dict (any TP/PP/EP);
            keys under `optimizer.` are left out.
        out: a new directory: `config.json`, `model-0000i-of-0000N.safetensors`,
            `model.safetensors.index.json`.
        config: the model's description: megatron `TransformerConfig` / GPTModel field names
            (or Megatron-LM's argument names) as a dict, a JSON file or JSON text. Default:
            the one `import_hf` stored, else Megatron-LM's `args` in the common state.
        max_shard_size: bytes (or e.g. "5GB") per safetensors file.

    Returns:
        The files written, the HF tensors and their bytes.

    Raises:
        CheckpointingException: not a Llama / Mixtral-style GPTModel (every unmapped name is
            listed), no description, or `out` already holding a model (CheckpointExistsError).
    """
    ckpt, dest = Path(ckpt), Path(out)
    limit = parse_size(max_shard_size)
    metadata, checksums = _source(ckpt)
    units, num_layers = _plan_export(_storage.tensor_entries(metadata))
    shapes = {u.name: u.shape for u in units}
    missing = {"embedding.word_embeddings.weight", "self_attention.linear_qkv.weight"} - set(shapes)
    if missing:
        raise CheckpointingException(f"{ckpt}: not a GPTModel checkpoint: no {sorted(missing)}")
    cfg = hf_map.hf_config(_description(ckpt, metadata, config), shapes, num_layers)
    heads, groups, d = (cfg[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim"))
    vocab = cfg["vocab_size"]

    def outputs(u: _Unit) -> List[Tuple[str, torch.dtype, Tuple[int, ...]]]:
        if u.name.endswith("linear_qkv.weight"):
            rows = [heads * d, groups * d, groups * d]
        elif u.name.endswith("linear_fc1.weight"):
            rows = [u.shape[0] // 2] * 2
        else:  # megatron pads the vocabulary: the rows past vocab_size are not exported
            rows = [min(u.shape[0], vocab) if u.key in hf_map.GLOBAL else u.shape[0]]
        return [(n, u.dtype, (r, *u.shape[1:])) for n, r in zip(u.hf, rows)]

    if (dest / SAFETENSORS_INDEX).exists() or (dest / "config.json").exists():
        raise CheckpointExistsError(f"{dest} already holds a model; choose another directory")
    dest.mkdir(parents=True, exist_ok=True)
    files: List[List[_Unit]] = [[]]
    size = 0
    for u in units:  # the HF tensors of one unit stay in one file
        nbytes = sum(torch.Size(s).numel() * t.itemsize for _, t, s in outputs(u))
        if files[-1] and size + nbytes > limit:
            files.append([])
            size = 0
        files[-1].append(u)
        size += nbytes
    names = [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    result, weight_map = ConvertResult(), {}
    for name, group in zip(names, files):
        entries = [e for u in group for e in outputs(u)]
        with open(dest / name, "wb") as f:
            f.write(safetensors_header(entries))
            for u in group:
                t = _storage.read_full_tensor(ckpt, metadata, u.key, checksums, u.index)
                for (hf_name, _, shape), part in zip(
                    outputs(u), hf_map.split(u.name, t, heads, groups)
                ):
                    f.write(tensor_bytes(part[: shape[0]]))
                    weight_map[hf_name] = name
                    result.tensors += 1
                    result.bytes += part[: shape[0]].nbytes
        result.files.append(str(dest / name))
    index = {"metadata": {"total_size": result.bytes}, "weight_map": weight_map}
    (dest / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    (dest / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    result.files += [str(dest / SAFETENSORS_INDEX), str(dest / "config.json")]
    logger.info("exported %d tensors (%d bytes) to %s", result.tensors, result.bytes, dest)
    return result


def _open_safetensors(hf_dir: Path) -> Dict[str, torch.Tensor]:
    """Every tensor of an HF model directory, mapped from its files (not read into memory)."""
    index = hf_dir / SAFETENSORS_INDEX
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (hf_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise CheckpointingException(f"{hf_dir}: no {SAFETENSORS_INDEX} or model.safetensors")
    codes = {code: dtype for dtype, code in SAFETENSORS_DTYPES.items()}
    tensors: Dict[str, torch.Tensor] = {}
    for name in files:
        path = hf_dir / name
        with open(path, "rb") as f:  # copy-on-write: writable for torch, never written back
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        try:
            (n,) = struct.unpack("<Q", mm[:8])
            header = json.loads(mm[8 : 8 + n])
            for key, info in header.items():
                if key == "__metadata__":
                    continue
                start, end = info["data_offsets"]
                raw = torch.frombuffer(
                    mm, dtype=torch.uint8, count=end - start, offset=8 + n + start
                )
                tensors[key] = raw.view(codes[info["dtype"]]).view(info["shape"])
        except (KeyError, ValueError, struct.error, RuntimeError) as e:
            raise CheckpointingException(f"{path}: not a readable safetensors file: {e!r}") from e
    return tensors


def import_hf(
    hf_dir: PathArg, ckpt: PathArg, *, tp: int = 1, pp: int = 1, ep: int = 1
) -> ConvertResult:
    """Writes a HuggingFace Llama / Mixtral model as a `torch_dist` checkpoint that
    megatron-core's GPTModel loads at tensor / pipeline / expert parallel sizes `tp`/`pp`/`ep`.

    The checkpoint holds global tensors (so it loads at other splits too); the split is
    checked against the model's sizes and recorded in the stored description (the
    `megatron_config` object, which `export_hf` reads back). Layer numbers are global
    (megatron's layer-stacked keys), the vocabulary is not padded.

    Steps: read `config.json`; map the safetensors files; fuse each layer's q/k/v; hand
    every tensor to `save` (one process, no process group).

    Args:
        hf_dir: a directory with `config.json` and safetensors files (`save_pretrained`'s).
        ckpt: the checkpoint directory to write.
        tp: tensor parallel size; pp: pipeline parallel size; ep: expert parallel size.

    Returns:
        `ckpt`, the megatron tensors and their bytes.

    Raises:
        CheckpointingException: not a Llama / Mixtral model, a split its sizes do not divide,
            or a tensor with no megatron name (all listed).
    """
    from .. import serialization
    from ..mapping import ShardedObject, ShardedTensor

    src = Path(hf_dir)
    try:
        cfg = json.loads((src / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointingException(f"{src}: no readable config.json: {e}") from e
    desc = hf_map.megatron_description(cfg, tp, pp, ep)
    hf = _open_safetensors(src)
    heads, groups = desc["num_attention_heads"], desc["num_query_groups"]
    n_layers, n_experts = int(desc["num_layers"]), int(desc.get("num_moe_experts") or 0)
    used: set = set()

    def take(name: str) -> torch.Tensor:
        if name not in hf:
            raise CheckpointingException(f"{src}: no tensor {name!r}")
        used.add(name)
        return hf[name]

    sd: Dict[str, Any] = {}

    def add(key: str, name: str, parts: List[torch.Tensor], *lead: Tuple[int, int, int]) -> None:
        """Stores `parts` fused at the (layer, expert) position `lead` of a stacked key."""
        n = len(lead)
        if name.endswith("linear_fc1.weight"):  # [gate; up]: two pieces as they are, no copy
            pieces = [(p, (*lead, (n, k, 2))) for k, p in enumerate(parts)]
        else:
            pieces = [(hf_map.fuse(name, parts, heads, groups), lead)]
        for t, offsets in pieces:
            sh = ShardedTensor.from_rank_offsets(key, t, *offsets, prepend_axis_num=n)
            sd[f"{key} {[o[1] for o in offsets]}"] = sh

    for key, name in hf_map.GLOBAL.items():
        if name != "lm_head.weight" or not desc["share_embeddings_and_output_weights"]:
            add(key, key, [take(name)])
    layer_names = [
        n for n in hf_map.LAYER if n not in ("input_layernorm.weight", "pre_mlp_layernorm.weight")
    ]
    for i in range(n_layers):
        for name in layer_names:
            moe_name = name == "mlp.router.weight"
            if (name in hf_map.DENSE_ONLY and n_experts) or (moe_name and not n_experts):
                continue
            parts = [take(f"model.layers.{i}.{n}") for n in hf_map.LAYER[name]]
            add(f"decoder.layers.{name}", name, parts, (0, i, n_layers))
        for x in range(n_experts):
            for name, hf_names in hf_map.EXPERT.items():
                prefix = f"model.layers.{i}.block_sparse_moe.experts.{x}."
                parts = [take(prefix + n) for n in hf_names]
                key = f"decoder.layers.mlp.experts.experts.{name}"
                add(key, name, parts, (0, i, n_layers), (1, x, n_experts))
    left = sorted(set(hf) - used)
    if left:
        raise CheckpointingException(
            f"{src}: {len(left)} tensor(s) have no megatron-core GPTModel name: " + ", ".join(left)
        )
    # megatron's linear layers save an `_extra_state` object per layer (and expert); its load
    # asks for them, so they are written as a freshly built model holds them (empty)
    extra = ["self_attention.linear_qkv", "self_attention.linear_proj"]
    extra += (
        ["mlp.experts.experts.linear_fc1", "mlp.experts.experts.linear_fc2"]
        if n_experts
        else ["mlp.linear_fc1", "mlp.linear_fc2"]
    )
    for name in extra:
        grid: Tuple[int, ...] = (n_layers, n_experts) if "experts" in name else (n_layers,)
        for pos in _product([range(n) for n in grid]):
            value = [None] if n_experts and "experts" in name else None
            sd[f"{name}._extra_state {pos}"] = ShardedObject(
                f"decoder.layers.{name}._extra_state", value, grid, pos
            )
    sd[DESCRIPTION_KEY] = ShardedObject(DESCRIPTION_KEY, desc, (1,), (0,))
    serialization.save(sd, str(ckpt))
    tensors = [v for v in sd.values() if isinstance(v, ShardedTensor)]
    return ConvertResult(
        [str(ckpt)], len(tensors), sum(t.data.nbytes for t in tensors if t.data is not None)
    )
