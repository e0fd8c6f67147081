"""Save / load to an S3-compatible store: ours, DCP through fsspec/s3fs, and the store's ceiling.

One run, the same server, fp32 state split on rows across ranks (16 tensors):

- `ours`: `dist_checkpointing.save` / `load` to `s3://bucket/prefix` (defaults: checksums
  on, `DIST_CKPT_S3_PART_MB` parts, `DIST_CKPT_S3_CONCURRENCY` requests in flight per rank);
- `dcp`: `torch.distributed.checkpoint.save` / `load` of DTensors with its `FsspecWriter` /
  `FsspecReader` (s3fs) at their defaults; with `--dcp-python` in another interpreter (a venv
  where a current s3fs and its aiobotocore's pinned botocore are installed);
- `ceiling`: the same bytes per rank as 2 objects (ours writes 2 data files per rank), a
  plain parallel multipart upload with boto3 from the tensors' memory (same part size and
  concurrency as ours), and ranged GETs of part size back into the same buffers.

Every method runs in its own world of gloo processes; the methods take turns in each repeat,
in an order rotated every repeat. A step's time runs from a barrier until every rank is done;
figures are medians over the repeats; ratios are against the ceiling of the same run. `CPU
s`: user + system seconds of the busiest rank's process in the step (the server's not
included), less sensitive than wall time to other jobs on a shared machine.

    python -m benchmarks.bench_s3 --start-server --size-mib 1024 --repeats 3 \\
        --dcp-python /work/venvs/s3fs/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist

from benchmarks._common import (
    init_world,
    max_over_ranks,
    median,
    print_table,
    rotated,
    run_world,
    timed,
)

METHODS = ["ceiling", "dcp", "ours"]
#: per method and repeat: seconds of each step, and CPU seconds of its busiest rank
KEYS = ["save", "load", "save CPU s", "load CPU s"]


def _shapes(total: int, world: int) -> List[tuple]:
    rows = max(world, (total // 16 // 4 // 1024) // world * world)
    return [(rows, 1024)] * 16


def _pieces(shapes: List[tuple], rank: int, world: int, data: bool) -> List[torch.Tensor]:
    out = []
    for i, (rows, cols) in enumerate(shapes):
        b = rows // world
        g = torch.Generator().manual_seed(i * world + rank)
        out.append(torch.randn(b, cols, generator=g) if data else torch.zeros(b, cols))
    return out


def _ours(url: str, pieces: List[torch.Tensor], shapes: List[tuple], save: bool) -> None:
    import dist_checkpointing as dc
    from dist_checkpointing import ShardedTensor

    r, w = dist.get_rank(), dist.get_world_size()
    sd = {
        f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", t, (0, r, w))
        for i, t in enumerate(pieces)
    }
    dc.save(sd, url) if save else dc.load(sd, url)


def _dcp(url: str, pieces: List[torch.Tensor], endpoint: str, save: bool) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    from torch.distributed.tensor import DTensor, Shard, init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    sd = {
        f"t{i}": DTensor.from_local(t, mesh, [Shard(0)], run_check=False)
        for i, t in enumerate(pieces)
    }
    opts = {"client_kwargs": {"endpoint_url": endpoint}}
    if save:
        dcp.save(sd, storage_writer=FsspecWriter(url, **opts))  # type: ignore[arg-type]
    else:
        dcp.load(sd, storage_reader=FsspecReader(url, **opts))  # type: ignore[arg-type]


class _Ceiling:
    """Plain boto3: each rank's bytes as 2 objects, multipart up, ranged GETs down."""

    def __init__(self, pieces: List[torch.Tensor], part: int, concurrency: int) -> None:
        import boto3
        from botocore.config import Config

        config = Config(max_pool_connections=2 * concurrency + 4, retries={"mode": "standard"})
        self.client = boto3.session.Session().client("s3", config=config)
        self.pool = ThreadPoolExecutor(concurrency)
        self.part = part
        self.flat = torch.cat([t.reshape(-1) for t in pieces]).view(torch.uint8).numpy()
        half = self.flat.size // 2
        self.views = [self.flat[:half], self.flat[half:]]

    def save(self, bucket: str, prefix: str) -> None:
        c, r = self.client, dist.get_rank()
        uploads = []
        for k, view in enumerate(self.views):
            key = f"{prefix}/raw_{r}_{k}"
            uid = c.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
            parts = [
                self.pool.submit(self._put, bucket, key, uid, n + 1, view[s : s + self.part])
                for n, s in enumerate(range(0, view.size, self.part))
            ]
            uploads.append((key, uid, parts))
        for key, uid, parts in uploads:
            done = {"Parts": [f.result() for f in parts]}
            c.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=uid, MultipartUpload=done)

    def _put(self, bucket: str, key: str, uid: str, n: int, view: Any) -> Dict[str, Any]:
        kw = {"UploadId": uid, "PartNumber": n, "Body": bytearray(view)}  # boto3 takes bytes
        return {
            "PartNumber": n,
            "ETag": self.client.upload_part(Bucket=bucket, Key=key, **kw)["ETag"],
        }

    def load(self, bucket: str, prefix: str) -> None:
        r, jobs = dist.get_rank(), []
        for k, view in enumerate(self.views):
            for s in range(0, view.size, self.part):
                jobs.append(self.pool.submit(self._get, bucket, f"{prefix}/raw_{r}_{k}", view, s))
        for j in jobs:
            j.result()

    def _get(self, bucket: str, key: str, view: Any, s: int) -> None:
        n = min(self.part, view.size - s)
        got = self.client.get_object(Bucket=bucket, Key=key, Range=f"bytes={s}-{s + n - 1}")
        view[s : s + n] = memoryview(got["Body"].read())


def _cpu(fn: Callable[[], float]) -> Tuple[float, float]:
    """`fn()`'s result and the CPU seconds (user + system, all threads) this process spent."""
    before = os.times()
    out = fn()
    after = os.times()
    return out, (after.user - before.user) + (after.system - before.system)


def _world(rank: int, world: int, args: argparse.Namespace, port: int, queue: Any) -> None:
    init_world(rank, world, port)
    torch.set_num_threads(1)
    shapes = _shapes(args.size_mib << 20, world)
    url = f"s3://{args.bucket}/{args.prefix}"
    data, dest = _pieces(shapes, rank, world, True), _pieces(shapes, rank, world, False)
    if args.worker == "ceiling":
        up = _Ceiling(data, args.part_mb << 20, args.concurrency)
        down = _Ceiling(dest, args.part_mb << 20, args.concurrency)
        t_save, c_save = _cpu(lambda: timed(lambda: up.save(args.bucket, args.prefix)))
        t_load, c_load = _cpu(lambda: timed(lambda: down.load(args.bucket, args.prefix)))
        ok = bool((up.flat == down.flat).all())
    else:
        if args.worker == "ours":
            import dist_checkpointing.serialization as ser

            ser.get_default_save_sharded_strategy()  # registry set up outside the timing

            def run(save: bool) -> None:
                _ours(url, data if save else dest, shapes, save)
        else:

            def run(save: bool) -> None:
                _dcp(url, data if save else dest, args.endpoint, save)

        t_save, c_save = _cpu(lambda: timed(lambda: run(True)))
        t_load, c_load = _cpu(lambda: timed(lambda: run(False)))
        ok = all(torch.equal(a, b) for a, b in zip(data, dest))
    ok = max_over_ranks(0.0 if ok else 1.0) == 0.0
    c_save, c_load = max_over_ranks(c_save), max_over_ranks(c_load)
    if rank == 0:
        nbytes = sum(r * c * 4 for r, c in shapes)
        cpu = {"save CPU s": c_save, "load CPU s": c_load}
        queue.put({"save": t_save, "load": t_load, **cpu, "ok": ok, "bytes": nbytes})
    dist.destroy_process_group()


def _worker_main(args: argparse.Namespace) -> None:
    os.environ["AWS_ENDPOINT_URL"] = args.endpoint
    os.environ["DIST_CKPT_S3_PART_MB"] = str(args.part_mb)
    os.environ["DIST_CKPT_S3_CONCURRENCY"] = str(args.concurrency)
    print("RESULT " + json.dumps(run_world(_world, args.world, args)))


def _clear(client: Any, bucket: str, prefix: str) -> None:
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--start-server", action="store_true", help="run moto_server on 127.0.0.1")
    parser.add_argument("--endpoint", default=os.environ.get("AWS_ENDPOINT_URL", ""))
    parser.add_argument("--bucket", default="")
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--part-mb", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--dcp-python", default=sys.executable, help="interpreter for `dcp`")
    parser.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--prefix", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker_main(args)
        return
    import boto3

    from tests.s3._server import CREDENTIALS, start_server

    for k, v in {**CREDENTIALS, "AWS_DEFAULT_REGION": "us-east-1"}.items():
        os.environ.setdefault(k, v)
    server = None
    if args.start_server:
        server, args.endpoint = start_server()
    os.environ["AWS_ENDPOINT_URL"] = args.endpoint
    try:
        client = boto3.client("s3")
        if not args.bucket:
            args.bucket = f"bench-{uuid.uuid4().hex[:8]}"
            client.create_bucket(Bucket=args.bucket)
        times: Dict[str, Dict[str, List[float]]] = {m: {k: [] for k in KEYS} for m in args.methods}
        nbytes = 0
        for rep in range(args.repeats):
            for m in rotated(list(args.methods), rep):
                prefix = f"bench/{m}-{rep}"
                python = args.dcp_python if m == "dcp" else sys.executable
                cmd = [python, "-m", "benchmarks.bench_s3", "--worker", m, "--prefix", prefix]
                for opt in ("endpoint", "bucket", "size_mib", "world", "part_mb", "concurrency"):
                    cmd += [f"--{opt.replace('_', '-')}", str(getattr(args, opt))]
                env = {**os.environ, "PYTHONPATH": os.getcwd()}
                out = subprocess.run(cmd, capture_output=True, text=True, env=env)
                lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
                if out.returncode or not lines:
                    sys.exit(f"{m} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
                res = json.loads(lines[-1][7:])
                if not res["ok"]:
                    sys.exit(f"{m}: loaded data differ from the saved data")
                nbytes = res["bytes"]
                for k in KEYS:
                    times[m][k].append(res[k])
                print(f"repeat {rep} {m}: " + ", ".join(f"{k} {res[k]:.2f}" for k in KEYS))
                _clear(client, args.bucket, prefix)
        rows = []
        ceil = (
            {k: median(times["ceiling"][k]) for k in ("save", "load")} if "ceiling" in times else {}
        )
        dcp = {k: median(times["dcp"][k]) for k in ("save", "load")} if "dcp" in times else {}
        for m, t in times.items():
            row: Dict[str, Any] = {"method": m}
            for k in ("save", "load"):
                s = median(t[k])
                row[f"{k} GB/s"] = nbytes / s / 1e9
                row[f"{k} x ceil"] = ceil[k] / s if ceil else None
                row[f"{k} x dcp"] = dcp[k] / s if dcp else None
                row[f"{k} CPU s"] = median(t[f"{k} CPU s"])
            rows.append(row)
        cols = ["method"] + [
            f"{k} {c}" for k in ("save", "load") for c in ("GB/s", "x ceil", "x dcp", "CPU s")
        ]
        print_table(
            f"{nbytes / 2**30:.2f} GiB, {args.world} ranks, part {args.part_mb} MiB x "
            f"{args.concurrency} in flight, {time.strftime('%Y-%m-%d %H:%M')}, load average "
            f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}: medians of {args.repeats}",
            rows,
            cols,
        )
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)


if __name__ == "__main__":
    main()
