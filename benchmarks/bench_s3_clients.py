"""Object-store clients on the same bytes: one process, one object, multipart up, ranged GETs down.

Each client importable in this interpreter uploads `--size-mib` of random bytes as one
object in parts of `--part-mb` with `--concurrency` requests in flight, then downloads it
in ranged GETs of the same size with the same concurrency (the client choice of
docs/s3.md): boto3 (its s3transfer manager), obstore (`put`, `get_range_async`
per part: its `get_ranges` merges adjacent ranges into one GET), s3fs
(`pipe`, `cat_ranges`). Run it in each venv against one server:

    python -m benchmarks.bench_s3_clients --start-server --size-mib 512 --repeats 3
    other-venv/bin/python -m benchmarks.bench_s3_clients --endpoint http://127.0.0.1:PORT
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import statistics
import time
import uuid
from typing import Any, Callable, Dict, List, Tuple


def _boto3(bucket: str, part: int, conc: int) -> Tuple[Callable, Callable]:
    import boto3
    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config

    client = boto3.client("s3", config=Config(max_pool_connections=conc + 4))
    cfg = TransferConfig(multipart_threshold=part, multipart_chunksize=part, max_concurrency=conc)

    def up(key: str, data: bytes) -> None:
        client.upload_fileobj(io.BytesIO(data), bucket, key, Config=cfg)

    def down(key: str, n: int) -> Any:
        out = io.BytesIO()
        client.download_fileobj(bucket, key, out, Config=cfg)
        return out.getbuffer()

    return up, down


def _obstore(bucket: str, part: int, conc: int) -> Tuple[Callable, Callable]:
    import obstore
    from obstore.store import S3Store

    store = S3Store(
        bucket, endpoint=os.environ["AWS_ENDPOINT_URL"], client_options={"allow_http": True}
    )

    def up(key: str, data: bytes) -> None:
        obstore.put(store, key, data, chunk_size=part, max_concurrency=conc)

    def down(key: str, n: int) -> Any:  # one GET per part, `conc` at a time
        async def all_parts() -> List[Any]:
            gate = asyncio.Semaphore(conc)

            async def one(s: int) -> Any:
                async with gate:
                    return await obstore.get_range_async(store, key, start=s, end=min(n, s + part))

            return await asyncio.gather(*(one(s) for s in range(0, n, part)))

        return b"".join(bytes(b) for b in asyncio.run(all_parts()))

    return up, down


def _s3fs(bucket: str, part: int, conc: int) -> Tuple[Callable, Callable]:
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=os.environ["AWS_ENDPOINT_URL"], max_concurrency=conc)

    def up(key: str, data: bytes) -> None:
        fs.pipe(f"{bucket}/{key}", data, chunksize=part)

    def down(key: str, n: int) -> Any:
        starts = list(range(0, n, part))
        ends = [min(n, s + part) for s in starts]
        return b"".join(fs.cat_ranges([f"{bucket}/{key}"] * len(starts), starts, ends))

    return up, down


CLIENTS = {"boto3": _boto3, "obstore": _obstore, "s3fs": _s3fs}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--start-server", action="store_true")
    parser.add_argument("--endpoint", default=os.environ.get("AWS_ENDPOINT_URL", ""))
    parser.add_argument("--size-mib", type=int, default=512)
    parser.add_argument("--part-mb", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    for k, v in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    server = None
    if args.start_server:
        from tests.s3._server import start_server

        server, args.endpoint = start_server()
    os.environ["AWS_ENDPOINT_URL"] = args.endpoint
    try:
        data = os.urandom(args.size_mib << 20)
        bucket = f"clients-{uuid.uuid4().hex[:8]}"
        _create_bucket(bucket)
        times: Dict[str, Dict[str, List[float]]] = {}
        for name, make in CLIENTS.items():
            try:
                up, down = make(bucket, args.part_mb << 20, args.concurrency)
            except Exception as e:  # not installed here, or too old (s3fs 0.4 beside boto3)
                print(f"{name}: skipped ({type(e).__name__}: {e})")
                continue
            t = times.setdefault(name, {"up": [], "down": []})
            for rep in range(args.repeats):
                key = f"{name}/{rep}"
                start = time.perf_counter()
                up(key, data)
                t["up"].append(time.perf_counter() - start)
                start = time.perf_counter()
                got = down(key, len(data))
                t["down"].append(time.perf_counter() - start)
                assert bytes(got) == data, name
        for name, t in times.items():
            gbs = {k: len(data) / statistics.median(v) / 1e9 for k, v in t.items()}
            print(
                f"{name}: upload {gbs['up']:.3f} GB/s, download {gbs['down']:.3f} GB/s "
                f"(medians of {args.repeats}, {args.size_mib} MiB)"
            )
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)


def _create_bucket(bucket: str) -> None:
    """Creates the bucket with boto3, or s3fs where boto3 is not installed."""
    try:
        import boto3

        boto3.client("s3").create_bucket(Bucket=bucket)
    except ImportError:
        import s3fs

        s3fs.S3FileSystem(endpoint_url=os.environ["AWS_ENDPOINT_URL"]).mkdir(bucket)


if __name__ == "__main__":
    main()
