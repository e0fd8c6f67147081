"""`export_hf` / `import_hf`: megatron-core GPTModel checkpoints to and from HuggingFace
Llama / Mixtral. Not collective: a `torch_dist` checkpoint holds global tensors whatever
split saved it. Names and layouts: `hf_map`.
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import mmap
import struct
from pathlib import Path
from typing import Any, Dict, List, Tuple, Union

import torch

from ..errors import CheckpointExistsError, CheckpointingException
from . import _storage, convert, hf_map
from ._info import PathArg

__all__ = ["export_hf", "import_hf", "DESCRIPTION_KEY", "GENERATION_KEY"]

logger = logging.getLogger(__name__)

#: the ShardedObject in which `import_hf` stores the model's description (megatron's fields)
DESCRIPTION_KEY = "megatron_config"
#: the ShardedObject in which `import_hf` keeps the special token ids and the model's
#: `generation_config.json` (megatron has no field for them; `export_hf` writes them back)
GENERATION_KEY = "hf_generation"
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
#: `key[index]` (a layer / expert) -> HF tensors; `name`: GLOBAL key, LAYER or EXPERT name
_Unit = collections.namedtuple("_Unit", "key index name hf shape dtype")


def _plan_export(entries: Dict[str, Any]) -> Tuple[List[_Unit], int]:
    """Units in key order and the number of layers; raises on any unmapped name."""
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
        pieces = hf_map.stored_layers(key, shape)
        name = pieces[0][0] if pieces else ""
        expert = name.startswith("experts.")
        table = hf_map.EXPERT if expert else hf_map.LAYER
        local = name[len("experts.") :] if expert else name
        # experts only in a mixture-of-experts model, a dense MLP only in a dense one
        fits = moe if expert else not (moe and local in hf_map.DENSE_ONLY)
        if not pieces or local not in table or not fits:
            unmapped.append(key)
            continue
        for _, i, e, lead in pieces:
            base = f"model.layers.{i}." + (f"block_sparse_moe.experts.{e}." if expert else "")
            units.append(
                _Unit(key, lead, name, [base + n for n in table[local]], shape[len(lead) :], dtype)
            )
            layers.add(i)
    if unmapped:
        raise CheckpointingException(
            f"{len(unmapped)} stored tensor(s) have no HuggingFace Llama / Mixtral name: "
            + ", ".join(unmapped)
        )
    if skipped:
        logger.info("not exported: %d optimizer tensors", skipped)
    return units, len(layers)


def _description(
    ckpt: Path, metadata: Any, checksums: Any, config: Union[None, str, Dict[str, Any]]
) -> Any:
    """`config` (a dict, JSON file or JSON text), else the description `import_hf` stored."""
    if isinstance(config, dict):
        return config
    if config is not None:
        text = config if config.lstrip().startswith("{") else Path(config).read_text()
        try:
            return json.loads(text)
        except ValueError as e:
            raise CheckpointingException(f"config {config!r}: not JSON: {e}") from e
    if DESCRIPTION_KEY in {k.split("/")[0] for k in _storage.object_keys(metadata)}:
        return _storage.read_object(ckpt, metadata, f"{DESCRIPTION_KEY}/shard_0_1", checksums)
    raise CheckpointingException(
        f"{ckpt}: no model description stored; give one "
        '(e.g. --config \'{"num_attention_heads": 32, "rotary_base": 500000}\', '
        "megatron's TransformerConfig field names)"
    )


def _generation(
    ckpt: Path, metadata: Any, checksums: Any, desc: Dict[str, Any]
) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """The special token ids for `config.json` and the `generation_config.json` contents:
    what `import_hf` stored, updated by token ids the description gives; empty when
    neither tells them (they depend on the tokenizer: never guessed)."""
    stored: Dict[str, Any] = {}
    if GENERATION_KEY in {k.split("/")[0] for k in _storage.object_keys(metadata)}:
        stored = _storage.read_object(ckpt, metadata, f"{GENERATION_KEY}/shard_0_1", checksums)
        if not isinstance(stored, dict):
            raise CheckpointingException(f"{ckpt}: {GENERATION_KEY} is not a dict")
    tokens = {k: stored[k] for k in TOKEN_IDS if stored.get(k) is not None}
    tokens.update({k: desc[k] for k in TOKEN_IDS if desc.get(k) is not None})
    if not tokens:
        logger.warning("%s: no bos/eos token ids known; give them in the description", ckpt)
    generation = dict(stored.get("generation_config") or {})  # as the model had it
    for k, v in tokens.items():
        generation.setdefault(k, v)
    return tokens, generation


def export_hf(
    ckpt: PathArg,
    out: PathArg,
    *,
    config: Union[None, str, Dict[str, Any]] = None,
    max_shard_size: Union[int, str] = "5GB",
) -> convert.ConvertResult:
    """Writes a megatron-core GPTModel checkpoint as a HuggingFace Llama / Mixtral model.

    Steps: map every stored name (refusing unmapped ones); derive `config.json`; read, split
    and write one layer / expert at a time.

    Args:
        ckpt: a `torch_dist` GPTModel checkpoint (any TP/PP/EP); `optimizer.` keys are skipped.
        out: a new directory for `config.json` and safetensors files with their index.
        config: megatron `TransformerConfig` / GPTModel fields as a dict, JSON file or JSON
            text (default: the description `import_hf` stored); `bos_token_id`,
            `eos_token_id` and `pad_token_id` in it go to `config.json` and
            `generation_config.json` (besides what `import_hf` stored of them).
        max_shard_size: bytes (or e.g. "5GB") per safetensors file.

    Raises:
        CheckpointingException: not a Llama / Mixtral-style GPTModel (unmapped names listed),
            no description, or `out` already holding a model (CheckpointExistsError).
    """
    ckpt, dest = Path(ckpt), Path(out)
    limit = convert.parse_size(max_shard_size)
    metadata, checksums = convert._source(ckpt)
    units, num_layers = _plan_export(_storage.tensor_entries(metadata, ckpt))
    shapes = {u.name: u.shape for u in units}
    missing = {"embedding.word_embeddings.weight", "self_attention.linear_qkv.weight"} - set(shapes)
    if missing:
        raise CheckpointingException(f"{ckpt}: not a GPTModel checkpoint: no {sorted(missing)}")
    desc = _description(ckpt, metadata, checksums, config)
    cfg = hf_map.hf_config(desc, shapes, num_layers)
    tokens, generation = _generation(ckpt, metadata, checksums, desc)
    cfg.update(tokens)
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

    entries = [e for u in units for e in outputs(u)]
    source = {name: u for u in units for name in u.hf}
    parts: Dict[str, torch.Tensor] = {}

    def read(name: str) -> torch.Tensor:  # in file order: a unit's HF tensors come together
        if name not in parts:
            u = source[name]
            t = _storage.read_full_tensor(ckpt, metadata, u.key, checksums, u.index)
            split = hf_map.split(u.name, t, heads, groups)
            parts.update({n: p[: s[0]] for (n, _, s), p in zip(outputs(u), split)})
        return parts.pop(name)

    if (dest / "config.json").exists():
        raise CheckpointExistsError(f"{dest} already holds a model; choose another directory")
    files = convert._write_safetensors(entries, dest, limit, read)
    (dest / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    written = [*files, str(dest / "config.json")]
    if generation:
        (dest / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        written.append(str(dest / "generation_config.json"))
    nbytes = sum(map(convert._nbytes, entries))
    result = convert.ConvertResult(written, len(entries), nbytes)
    logger.info("exported %d tensors (%d bytes) to %s", result.tensors, result.bytes, dest)
    return result


def _open_safetensors(hf_dir: Path) -> Dict[str, torch.Tensor]:
    """Every tensor of an HF model directory, mapped from its files (not read into memory)."""
    index = hf_dir / convert.SAFETENSORS_INDEX
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (hf_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise CheckpointingException(f"{hf_dir}: no {index.name} or model.safetensors")
    codes = {code: dtype for dtype, code in convert.SAFETENSORS_DTYPES.items()}
    tensors: Dict[str, torch.Tensor] = {}
    for name in files:
        path = hf_dir / name
        with open(path, "rb") as f:  # copy-on-write: writable for torch, never written back
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        try:
            (n,) = struct.unpack("<Q", mm[:8])
            header = json.loads(mm[8 : 8 + n])
            header.pop("__metadata__", None)
            for key, info in header.items():
                start, end = (8 + n + offset for offset in info["data_offsets"])
                raw = torch.frombuffer(mm, dtype=torch.uint8, count=end - start, offset=start)
                tensors[key] = raw.view(codes[info["dtype"]]).view(info["shape"])
        except (KeyError, ValueError, struct.error, RuntimeError) as e:
            raise CheckpointingException(f"{path}: not a readable safetensors file: {e!r}") from e
    return tensors


def import_hf(
    hf_dir: PathArg, ckpt: PathArg, *, tp: int = 1, pp: int = 1, ep: int = 1
) -> convert.ConvertResult:
    """Writes a HuggingFace Llama / Mixtral model as a megatron-core GPTModel checkpoint.

    Steps: read `config.json` and check the split divides its sizes; map the safetensors
    files (unchanged tensors are not copied); fuse each layer's q/k/v; `save` with the
    description (`megatron_config`, read by `export_hf`). Tensors are global and
    layer-stacked, so any split loads them; the vocabulary is not padded.

    Args:
        hf_dir: a `save_pretrained` directory (`config.json`, safetensors files).
        ckpt: the checkpoint directory to write.
        tp, pp, ep: the tensor, pipeline and expert parallel sizes it is checked for.

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
        hf_config = json.loads((src / "config.json").read_text())
        desc = hf_map.megatron_description(hf_config, tp, pp, ep)
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointingException(f"{src}: no readable config.json ({e!r})") from e
    hf, used = _open_safetensors(src), set()
    heads, groups = desc["num_attention_heads"], desc["num_query_groups"]
    n_layers, n_experts = int(desc["num_layers"]), int(desc.get("num_moe_experts") or 0)
    sd: Dict[str, Any] = {}

    def add(key: str, name: str, hf_names: List[str], *lead: Tuple[int, int, int]) -> None:
        """Stores the HF tensors fused at (layer, expert) position `lead` of a stacked key."""
        missing = [n for n in hf_names if n not in hf]
        if missing:
            raise CheckpointingException(f"{src}: no tensor {missing[0]!r}")
        parts, n = [hf[n] for n in hf_names], len(lead)
        used.update(hf_names)
        if name.endswith("linear_fc1.weight"):  # [gate; up]: two pieces as they are, no copy
            pieces = [(p, (*lead, (n, k, 2))) for k, p in enumerate(parts)]
        else:
            pieces = [(hf_map.fuse(name, parts, heads, groups), lead)]
        for t, offsets in pieces:
            sh = ShardedTensor.from_rank_offsets(key, t, *offsets, prepend_axis_num=n)
            sd[f"{key} {[o[1] for o in offsets]}"] = sh

    for key, name in hf_map.GLOBAL.items():
        if name != "lm_head.weight" or not desc["share_embeddings_and_output_weights"]:
            add(key, key, [name])
    mlp = ("mlp.router.weight",) if n_experts else hf_map.DENSE_ONLY
    for i in range(n_layers):
        for name in [*list(hf_map.LAYER)[:4], *mlp]:  # megatron 0.16's spellings
            in_layer = [f"model.layers.{i}.{n}" for n in hf_map.LAYER[name]]
            add(f"decoder.layers.{name}", name, in_layer, (0, i, n_layers))
        for x, (name, hf_names) in itertools.product(range(n_experts), hf_map.EXPERT.items()):
            names = [f"model.layers.{i}.block_sparse_moe.experts.{x}.{n}" for n in hf_names]
            key = f"decoder.layers.mlp.experts.experts.{name}"
            add(key, name, names, (0, i, n_layers), (1, x, n_experts))
    left = sorted(set(hf) - used)
    if left:
        raise CheckpointingException(
            f"{src}: {len(left)} tensor(s) have no megatron-core GPTModel name: " + ", ".join(left)
        )
    # megatron's linear layers save an `_extra_state` object per layer (and expert) and its
    # load asks for them: written as a newly built model (local layer spec) holds them
    mlp_prefix = "mlp.experts.experts." if n_experts else "mlp."
    linears = ["self_attention.linear_qkv", "self_attention.linear_proj"]
    for name in linears + [f"{mlp_prefix}linear_fc{i}" for i in (1, 2)]:
        grid = (n_layers, n_experts) if "experts" in name else (n_layers,)
        for pos in itertools.product(*(range(n) for n in grid)):
            key = f"decoder.layers.{name}._extra_state"
            sd[f"{key} {pos}"] = ShardedObject(key, [None] if len(grid) > 1 else None, grid, pos)
    sd[DESCRIPTION_KEY] = ShardedObject(DESCRIPTION_KEY, desc, (1,), (0,))
    generation = {k: hf_config[k] for k in TOKEN_IDS if hf_config.get(k) is not None}
    if (src / "generation_config.json").is_file():
        try:
            generation["generation_config"] = json.loads(
                (src / "generation_config.json").read_text()
            )
        except ValueError as e:
            raise CheckpointingException(f"{src}/generation_config.json: not JSON: {e}") from e
    if generation:
        sd[GENERATION_KEY] = ShardedObject(GENERATION_KEY, generation, (1,), (0,))
    serialization.save(sd, str(ckpt))
    tensors = [v.data for v in sd.values() if isinstance(v, ShardedTensor)]
    nbytes = sum(int(t.nbytes) for t in tensors if t is not None)
    return convert.ConvertResult([str(ckpt)], len(tensors), nbytes)
