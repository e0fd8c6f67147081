"""The `dist-ckpt` command: `ls`, `inspect`, `verify`, `convert`, `diff`, `export-hf`,
`import-hf` and `demo`.

Exit codes: 0 success (or clean / equal), 1 a problem found in a checkpoint (incomplete,
damaged, different), 2 bad usage or input (a missing path, an unreadable checkpoint), 130
interrupted. Every error is one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict
from typing import Any, Callable, List, NoReturn, Optional

__all__ = ["main"]

EXIT_OK, EXIT_PROBLEM, EXIT_ERROR = 0, 1, 2


def _size(n: int) -> str:
    value, unit = float(n), "B"
    for bigger in ("KB", "MB", "GB", "TB"):
        if value < 1000:
            break
        value, unit = value / 1000, bigger
    return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"


def _print_json(data: Any, ok: bool = True) -> int:
    print(json.dumps(data, indent=2, sort_keys=True, default=str))
    return EXIT_OK if ok else EXIT_PROBLEM


def _ls(args: argparse.Namespace) -> int:
    from .tools.listing import list_checkpoints

    found = list_checkpoints(args.root)
    if args.json:
        return _print_json(
            [{**asdict(i), "state": i.state, "tensor_bytes": i.tensor_bytes} for i in found]
        )
    if not found:
        print(f"{args.root}: no checkpoints")
    for i in found:
        step = "-" if i.step is None else str(i.step)
        state = i.state if i.complete else i.state.upper()
        listed = i.complete and i.kind != "local" and (i.tensors or not i.note)
        tensors = str(len(i.tensors)) if listed else "-"
        print(
            f"{'*' if i.latest else ' '} {step:>8}  {state:<10}  {i.backend or '-':<15} "
            f"{_size(i.size):>10}  {tensors:>7} tensors  {i.date:<25}  {i.path}"
        )
        if i.problem or i.note:
            print(f"{'':>12}{i.problem or i.note}")
        if i.parity:
            print(f"{'':>12}{i.parity}")
    if any(i.latest for i in found):
        print("(* = latest)")
    return EXIT_OK  # incomplete entries are listed, not an error: a save may be running


def _inspect(args: argparse.Namespace) -> int:
    from .tools._light import Unsupported, describe_light

    try:  # complete torch_dist, DCP and local checkpoints without importing torch (fast)
        info = describe_light(args.path, step=args.step)
    except Unsupported:  # anything else: the full reader decides, and names any problem
        from .tools.inspect import describe

        info = describe(args.path, step=args.step)
    if args.json:
        data = {**asdict(info), "state": info.state, "tensor_bytes": info.tensor_bytes}
        return _print_json(data, info.complete)
    at = f" step {info.step}" if info.backend == "local tier" else ""
    if not info.complete:
        print(f"{info.path}{at}: {info.state} checkpoint: {info.problem}", file=sys.stderr)
        return EXIT_PROBLEM
    where = f" (world size {info.world_size})" if info.world_size else ""
    print(
        f"{info.path}{at}: {info.backend}{where}, {_size(info.size)} on disk, written {info.date}"
    )
    if info.note:
        print(f"  note: {info.note}")
        if not info.tensors and info.kind != "local":
            return EXIT_OK  # nothing the tools read: no tensor or checksum lines
    if info.tensors:
        print(f"  {'tensor':<40} {'shape':<20} {'dtype':<22} {'bytes':>14} {'shards':>6}")
    for t in info.tensors:
        print(
            f"  {t.key:<40} {str(tuple(t.shape)):<20} {t.dtype:<22} {t.nbytes:>14,} {t.shards:>6}"
        )
    for key, value in info.objects.items():
        print(f"  value   {key:<40} {value}")
    print(f"  tensor bytes: {info.tensor_bytes:,}")
    if info.parity:
        print(f"  parity: {info.parity}")
    c = info.checksums
    if c is None or not c.present:
        print("  checksums: none (written by another tool; loads are not verified)")
    elif info.kind == "local":
        print(f"  checksums: every tensor of all {c.items} rank parts (local image checksums)")
    else:
        print(
            f"  checksums: {c.items_covered}/{c.items} items, {c.bytes_covered:,}/{c.bytes:,} bytes, "
            f"files {', '.join(c.files_covered) or '-'}"
        )
    return EXIT_OK


def _verify(args: argparse.Namespace) -> int:
    from .tools.verify import verify_checkpoint

    report = verify_checkpoint(args.path, step=args.step)
    if args.json:
        return _print_json({**asdict(report), "ok": report.ok}, report.ok)
    at = f"{report.path}{'' if report.step is None else f' step {report.step}'}"
    how = "checksums" if report.checksummed else "structure only (no checksums recorded)"
    if report.ok:
        verdict = f"OK: {report.items} items, {report.bytes:,} bytes read"
    else:
        verdict = f"DAMAGED: {len(report.problems)} problem(s); {report.items} items"
    parity = [f"parity: {report.parity}"] if report.parity else []
    print("\n  ".join([f"{at}: {verdict}, {how}", *map(str, report.problems), *parity]))
    return EXIT_OK if report.ok else EXIT_PROBLEM


def _convert(args: argparse.Namespace) -> int:
    from .tools.convert import convert_checkpoint

    result = convert_checkpoint(args.path, args.out, args.to, max_shard_size=args.max_shard_size)
    if args.json:
        return _print_json(asdict(result))
    print(f"wrote {result.tensors} tensors ({_size(result.bytes)}) to {len(result.files)} file(s):")
    for f in result.files:
        print(f"  {f}")
    return EXIT_OK


def _hf(args: argparse.Namespace) -> int:
    from .tools import hf

    if args.command == "export-hf":
        result = hf.export_hf(
            args.ckpt, args.out, config=args.config, max_shard_size=args.max_shard_size
        )
    else:
        result = hf.import_hf(args.hf_dir, args.ckpt, tp=args.tp, pp=args.pp, ep=args.ep)
    if args.json:
        return _print_json(asdict(result))
    print(f"wrote {result.tensors} tensors ({_size(result.bytes)}): {result.files[0]}")
    return EXIT_OK


def _diff(args: argparse.Namespace) -> int:
    from .tools.diff import diff_checkpoints

    report = diff_checkpoints(args.a, args.b, rtol=args.rtol, atol=args.atol)
    if args.json:
        return _print_json({**asdict(report), "equal": report.equal}, report.equal)
    for key in report.only_in_a:
        print(f"only in A: {key}")
    for key in report.only_in_b:
        print(f"only in B: {key}")
    for key, what in report.mismatched:
        print(f"shape/dtype: {key}: {what}")
    for key, worst in report.differing:
        print(f"values differ: {key} (max abs difference {worst:.6g})")
    for key in report.differing_values:
        print(f"value differs: {key}")
    print(
        "equal" if report.equal else "different",
        f"({report.tensors_compared} tensors compared, rtol={args.rtol}, atol={args.atol})",
    )
    return EXIT_OK if report.equal else EXIT_PROBLEM


def _demo(args: argparse.Namespace) -> int:
    from .demo import DemoConfig, run_demo

    run_demo(DemoConfig(args.world_size, args.hidden, args.layers, args.vocab, args.dir, args.keep))
    return EXIT_OK


class _OneLineParser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line (exit 2), like every CLI error."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="dist-ckpt",
        description="Look inside, check, convert and compare dist_checkpointing checkpoints.",
        epilog="Exit codes: 0 ok/clean/equal, 1 problem found, 2 error.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def verb(name: str, fn: Callable[[argparse.Namespace], int], text: str) -> Any:
        p = sub.add_parser(name, help=text)
        p.set_defaults(fn=fn)
        return p

    ls = verb("ls", _ls, "list the checkpoints under a root, complete or not, newest first")
    ls.add_argument("root", help="directory to search (up to 4 levels down), e.g. a run's root")
    insp = verb("inspect", _inspect, "backend, tensors, shards, values and checksums")
    ver = verb("verify", _verify, "read every byte and check every checksum")
    for p in (insp, ver):
        p.add_argument("path", help="checkpoint directory, or a manager's local tier directory")
        p.add_argument("--step", type=int, help="local tier: which step (default: newest complete)")
    conv = verb(
        "convert", _convert, "write the full tensors as safetensors shards or one torch file"
    )
    conv.add_argument("path", help="torch_dist or PyTorch DCP checkpoint directory")
    conv.add_argument("out", help="output directory (safetensors) or file (torch)")
    conv.add_argument("--to", choices=("safetensors", "torch"), required=True)
    conv.add_argument(
        "--max-shard-size", default="5GB", help="bytes per safetensors file (default 5GB)"
    )
    exp = verb("export-hf", _hf, "a megatron GPTModel checkpoint as a HuggingFace Llama/Mixtral")
    exp.add_argument("ckpt", help="torch_dist checkpoint of megatron-core's GPTModel")
    exp.add_argument("out", help="new directory: config.json and safetensors files")
    exp.add_argument(
        "--config", help="the model's megatron fields: a JSON file or JSON text (default: stored)"
    )
    exp.add_argument("--max-shard-size", default="5GB", help="bytes per file (default 5GB)")
    imp = verb("import-hf", _hf, "a HuggingFace Llama/Mixtral as a megatron GPTModel checkpoint")
    imp.add_argument("hf_dir", help="directory with config.json and safetensors files")
    imp.add_argument("ckpt", help="the torch_dist checkpoint directory to write")
    for name in ("tp", "pp", "ep"):
        imp.add_argument(f"--{name}", type=int, default=1, help=f"{name.upper()} size (default 1)")
    diff = verb("diff", _diff, "compare two checkpoints (exit 0 only when equal)")
    diff.add_argument("a")
    diff.add_argument("b")
    diff.add_argument("--rtol", type=float, default=0.0, help="relative tolerance (default 0)")
    diff.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0)")
    for p in (ls, insp, ver, conv, exp, imp, diff):
        p.add_argument("--json", action="store_true", help="machine-readable output")

    demo = verb("demo", _demo, "save, reshard and load a multi-rank checkpoint on CPU")
    demo.add_argument("--world-size", type=int, default=4, help="processes (default 4)")
    demo.add_argument("--hidden", type=int, default=512, help="model width (default 512)")
    demo.add_argument("--layers", type=int, default=4, help="transformer layers (default 4)")
    demo.add_argument("--vocab", type=int, default=8192, help="embedding rows (default 8192)")
    demo.add_argument(
        "--dir", default="", help="parent of the checkpoint, kept (default: a temporary one)"
    )
    demo.add_argument("--keep", action="store_true", help="keep the temporary directory")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of `dist-ckpt` / `python -m dist_checkpointing`.

    Returns:
        The exit code (see the module docstring).
    """
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    fn: Callable[[argparse.Namespace], int] = args.fn
    try:
        return fn(args)
    except KeyboardInterrupt:
        print("dist-ckpt: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head`
        return EXIT_OK
    except Exception as e:  # one line per error, never a traceback
        from .errors import CheckpointingException

        known = isinstance(e, (CheckpointingException, ValueError, OSError))
        kind = "error" if known else f"internal error ({type(e).__name__})"
        text = " ".join(str(e).split())  # one line, at most 2000 characters
        text = text if len(text) <= 2000 else text[:1997] + "..."
        print(f"dist-ckpt {args.command}: {kind}: {text}", file=sys.stderr)
        return EXIT_ERROR
