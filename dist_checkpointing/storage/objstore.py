"""S3-compatible object storage behind the file interface of this package (`s3://` paths).

A checkpoint on a store is a key prefix. `ObjectWriter` has `FileWriter`'s interface and
streams a file as a parallel multipart upload: part buffers come from one process-wide
budget of `2 x concurrency`, so a rank holds at most `2 x part size x concurrency` bytes
however many files it writes at once. `read_range` fills a destination with parallel ranged
GETs of only the bytes asked for. The helpers at the end (`exists`, `listdir`, `makedirs`,
`remove_tree`, ...) take a local path or an object path alike, so callers keep one code
path. `pathlib.Path("s3://b/k")` prints as `s3:/b/k`; both spellings name the same object.
A path with any other scheme (`xyz://...`) is refused, never taken for a local directory.

The client is boto3 (optional extra `dist_checkpointing[s3]`), configured from the standard
AWS environment and config files (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, ...); throttling
and server errors are retried with backoff (`AWS_MAX_ATTEMPTS`, standard mode).
"""

from __future__ import annotations

import io
import logging
import os
import re
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from ..errors import CheckpointingException

__all__ = [
    "ObjectWriter",
    "split",
    "read_range",
    "read_object",
    "put_object",
    "exists",
    "is_file",
    "is_dir",
    "listdir",
    "makedirs",
    "remove",
    "remove_tree",
    "replace_tree",
]

logger = logging.getLogger(__name__)

_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+):/+(.*)", re.S)
#: part size and parallel requests per rank (`DIST_CKPT_S3_PART_MB`, `DIST_CKPT_S3_CONCURRENCY`)
_MB = 1 << 20
_clients: Dict[Tuple[Any, ...], Any] = {}  # thread-safe clients by process and configuration
_ENV = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE")
_lock = threading.Lock()
_budget: Optional[threading.BoundedSemaphore] = None


def part_size() -> int:
    """Bytes per uploaded part and per ranged GET (>= 5 MiB, S3's smallest part)."""
    return max(5, int(os.environ.get("DIST_CKPT_S3_PART_MB", "16"))) * _MB


def concurrency() -> int:
    """Requests in flight per rank."""
    return max(1, int(os.environ.get("DIST_CKPT_S3_CONCURRENCY", "8")))


def split(path: Any) -> Optional[Tuple[str, str]]:
    """`(bucket, key)` of an `s3://` path (also as `pathlib` prints it), None for a local one.

    Raises:
        CheckpointingException: a scheme other than s3, or no bucket.
    """
    m = _SCHEME.fullmatch(os.fspath(path))
    if m is None:
        return None
    if m.group(1).lower() != "s3":
        raise CheckpointingException(
            f"{os.fspath(path)}: unsupported URL scheme {m.group(1)!r} (supported: local paths "
            "and s3://bucket/prefix)"
        )
    bucket, _, key = m.group(2).partition("/")
    if not bucket:
        raise CheckpointingException(f"{os.fspath(path)}: no bucket in the s3:// path")
    return bucket, key.strip("/")


def _client() -> Any:
    pid = (os.getpid(), *(os.environ.get(k) for k in _ENV))  # forked workers, changed settings
    with _lock:
        if pid not in _clients:
            try:
                import boto3
                from botocore.config import Config
            except ImportError as e:
                raise CheckpointingException(
                    "s3:// paths need boto3: pip install 'dist_checkpointing[s3]'"
                ) from e
            config = Config(
                retries={
                    "mode": "standard",
                    "max_attempts": int(os.environ.get("AWS_MAX_ATTEMPTS", 5)),
                },
                max_pool_connections=2 * concurrency() + 4,
            )
            _clients[pid] = boto3.session.Session().client("s3", config=config)
        return _clients[pid]


def _call(what: str, bucket: str, key: str, method: str, **kw: Any) -> Any:
    """One request; a failure becomes a CheckpointingException naming object and endpoint
    (FileNotFoundError for a missing key or upload, so callers treat it as a missing file)."""
    client = _client()
    try:
        return getattr(client, method)(Bucket=bucket, **kw)
    except Exception as e:
        code = str(getattr(e, "response", {}).get("Error", {}).get("Code", ""))
        where = f"s3://{bucket}/{key} at {client.meta.endpoint_url}"
        if code in ("NoSuchKey", "404", "NoSuchUpload"):
            raise FileNotFoundError(f"{where}: no such object") from e
        if code == "NoSuchBucket":
            raise CheckpointingException(f"{what} {where}: bucket {bucket!r} does not exist") from e
        raise CheckpointingException(f"{what} {where} failed: {type(e).__name__}: {e}") from e


def _part_budget() -> threading.BoundedSemaphore:
    global _budget
    with _lock:
        if _budget is None:
            _budget = threading.BoundedSemaphore(2 * concurrency())
        return _budget


_pool: Optional[ThreadPoolExecutor] = None


def _io_pool() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:  # created on first use, never at import
            _pool = ThreadPoolExecutor(concurrency(), thread_name_prefix="dc-s3")
        return _pool


class ObjectWriter:
    """Writes one object from sequential `write`s as a parallel multipart upload.

    Same interface as `FileWriter` (`write(view, offset)`, `finish()`, `abort()`); the
    object appears only when `finish` completes the upload, whole.

    Args:
        path: `s3://bucket/key`.
        size: the object's final size.
    """

    direct = False

    def __init__(self, path: Any, size: int, *args: Any, **kwargs: Any) -> None:
        self.path, self.size = os.fspath(path), size
        self._bucket, self._key = split(path) or ("", "")
        self._part = part_size()
        self._buf: Optional[bytearray] = None
        self._fill = 0
        self._pos = 0
        self._upload_id: Optional[str] = None
        self._parts: List[Tuple[int, Future]] = []

    def _take(self) -> bytearray:
        _part_budget().acquire()
        return bytearray(self._part)

    def write(self, view: memoryview, offset: int) -> None:
        """Appends `view` (its bytes past `size` are padding and dropped) at `offset`."""
        if offset != self._pos:
            raise CheckpointingException(f"{self.path}: write at {offset}, expected {self._pos}")
        data = memoryview(view).cast("B")[: max(0, self.size - offset)]
        self._pos += len(data)
        while len(data):
            if self._buf is None:
                self._buf = self._take()
            n = min(len(data), self._part - self._fill)
            self._buf[self._fill : self._fill + n] = data[:n]
            self._fill, data = self._fill + n, data[n:]
            if self._fill == self._part and (len(data) or self._pos < self.size):
                self._send()

    def _send(self) -> None:
        """Hands the full part buffer to an upload thread (which returns it to the budget)."""
        if self._upload_id is None:
            self._upload_id = _call(
                "upload to", self._bucket, self._key, "create_multipart_upload", Key=self._key
            )["UploadId"]
        assert self._buf is not None
        buf, number = self._buf, len(self._parts) + 1
        body = buf if self._fill == len(buf) else bytes(buf[: self._fill])  # the last part
        self._buf, self._fill = None, 0

        def upload() -> str:
            try:
                return _call(
                    "upload to",
                    self._bucket,
                    self._key,
                    "upload_part",
                    Key=self._key,
                    UploadId=self._upload_id,
                    PartNumber=number,
                    Body=body,
                )["ETag"]
            finally:
                _part_budget().release()

        self._parts.append((number, _io_pool().submit(upload)))

    def finish(self) -> None:
        """Uploads the rest and completes the object (a single PUT when it fits in a part).

        Raises:
            CheckpointingException: an upload failed (the partial upload is aborted).
        """
        try:
            if self._pos != self.size:
                raise CheckpointingException(
                    f"{self.path}: {self._pos} of {self.size} bytes written"
                )
            if self._upload_id is None:
                body = bytes(self._buf[: self._fill]) if self._buf is not None else b""
                self._drop_buffer()
                put_object(self.path, body)
                return
            self._send()
            parts = [{"PartNumber": n, "ETag": f.result()} for n, f in self._parts]
            _call(
                "upload to",
                self._bucket,
                self._key,
                "complete_multipart_upload",
                Key=self._key,
                UploadId=self._upload_id,
                MultipartUpload={"Parts": parts},
            )
            self._upload_id = None
        except BaseException:
            self.abort()
            raise

    def _drop_buffer(self) -> None:
        if self._buf is not None:
            self._buf = None
            _part_budget().release()

    def abort(self, remove: bool = False) -> None:
        """Abandons the upload after a failure: nothing of it becomes visible."""
        self._drop_buffer()
        for _, f in self._parts:
            f.exception()  # every part thread has returned its buffer
        if self._upload_id is not None:
            upload_id, self._upload_id = self._upload_id, None
            try:
                _call(
                    "abort of",
                    self._bucket,
                    self._key,
                    "abort_multipart_upload",
                    Key=self._key,
                    UploadId=upload_id,
                )
            except Exception as e:  # the store's lifecycle rules clean it up
                logger.warning("could not abort the upload of %s: %s", self.path, e)


def read_range(
    path: Any, offset: int, out: np.ndarray, progress: Optional[Callable[[int], None]] = None
) -> None:
    """Fills `out` (flat uint8) from `offset` of an object with parallel ranged GETs.

    Raises:
        CheckpointCorruptedError: the object is shorter than the region or missing.
    """
    from ..errors import CheckpointCorruptedError

    bucket, key = split(path) or ("", "")
    step = part_size()

    def get(start: int) -> None:
        n = min(step, out.size - start)
        rng = f"bytes={offset + start}-{offset + start + n - 1}"
        try:
            body = _call("read of", bucket, key, "get_object", Key=key, Range=rng)["Body"]
        except FileNotFoundError as e:
            raise CheckpointCorruptedError(str(e)) from e
        got = body.read()
        if len(got) != n:
            raise CheckpointCorruptedError(f"{path}: short read at offset {offset + start}")
        out[start : start + n] = np.frombuffer(got, dtype=np.uint8)

    if out.size <= step:
        get(0)
        if progress is not None:
            progress(out.size)
        return
    starts = range(0, out.size, step)
    for s, f in zip(starts, [_io_pool().submit(get, s) for s in starts]):
        f.result()  # in order: `progress` sees the leading bytes grow
        if progress is not None:
            progress(min(out.size, s + step))


def read_object(path: Any, limit: Optional[int] = None) -> Optional[bytes]:
    """An object's bytes (at most `limit` + 1 of them), or None when it does not exist."""
    bucket, key = split(path) or ("", "")
    kw = {} if limit is None else {"Range": f"bytes=0-{limit}"}
    try:
        return _call("read of", bucket, key, "get_object", Key=key, **kw)["Body"].read()
    except FileNotFoundError:
        return None
    except CheckpointingException as e:
        if "InvalidRange" in str(e):  # a range of an empty object
            return b""
        raise


def put_object(path: Any, data: bytes) -> None:
    """Writes a whole object in one PUT (readers see the old object or all of the new one)."""
    bucket, key = split(path) or ("", "")
    _call("upload to", bucket, key, "put_object", Key=key, Body=data)


def _list(bucket: str, prefix: str, delimiter: str = "") -> Tuple[List[Any], List[str]]:
    """`(object entries: Key, Size, LastModified; sub-prefixes)` under `prefix`."""
    keys: List[Any] = []
    subs: List[str] = []
    token: Dict[str, str] = {}
    while True:
        kw = {"Prefix": prefix, "Delimiter": delimiter} if delimiter else {"Prefix": prefix}
        r = _call("listing of", bucket, prefix, "list_objects_v2", **kw, **token)
        keys += r.get("Contents", [])
        subs += [p["Prefix"] for p in r.get("CommonPrefixes", [])]
        if not r.get("IsTruncated"):
            return keys, subs
        token = {"ContinuationToken": r["NextContinuationToken"]}


def _dir_prefix(key: str) -> str:
    return f"{key}/" if key else ""


# ---- the same operations on local paths and object paths ---------------------------------


def is_file(path: Any) -> bool:
    """Whether a file (an object) exists at `path`."""
    loc = split(path)
    if loc is None:
        return os.path.isfile(path)
    try:
        _call("lookup of", loc[0], loc[1], "head_object", Key=loc[1])
        return True
    except FileNotFoundError:
        return False


def is_dir(path: Any) -> bool:
    """Whether `path` is a directory (any object under the prefix)."""
    loc = split(path)
    if loc is None:
        return os.path.isdir(path)
    keys, subs = _list(loc[0], _dir_prefix(loc[1]), "/")
    return bool(keys or subs)


def exists(path: Any) -> bool:
    """Whether a file or directory exists at `path`."""
    return is_file(path) or is_dir(path)


def listdir(path: Any) -> List[str]:
    """Names directly under a directory (FileNotFoundError if there is none)."""
    loc = split(path)
    if loc is None:
        return os.listdir(path)
    prefix = _dir_prefix(loc[1])
    keys, subs = _list(loc[0], prefix, "/")
    if not keys and not subs:
        raise FileNotFoundError(f"{path}: no objects under this prefix")
    return sorted({k[len(prefix) :].rstrip("/") for k in [o["Key"] for o in keys] + subs})


def makedirs(path: Any) -> None:
    """Creates a directory; for a prefix, checks that its bucket can be reached.

    Raises:
        CheckpointingException: the bucket is missing or refuses these credentials.
    """
    loc = split(path)
    if loc is None:
        os.makedirs(path, exist_ok=True)
        return
    try:
        _call("access to", loc[0], "", "head_bucket")
    except FileNotFoundError as e:  # HEAD answers a bare 404 for a missing bucket
        raise CheckpointingException(
            f"bucket {loc[0]!r} does not exist at {_client().meta.endpoint_url}"
        ) from e


def remove(path: Any) -> None:
    """Removes a file (an object) if it exists."""
    loc = split(path)
    if loc is None:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
        return
    _call("removal of", loc[0], loc[1], "delete_object", Key=loc[1])


def remove_tree(path: Any) -> None:
    """Removes a directory and everything under it (a prefix and its objects)."""
    loc = split(path)
    if loc is None:
        shutil.rmtree(path, ignore_errors=True)
        return
    keys = [o["Key"] for o in _list(loc[0], _dir_prefix(loc[1]))[0]]
    for i in range(0, len(keys), 1000):
        batch = {"Objects": [{"Key": k} for k in keys[i : i + 1000]], "Quiet": True}
        _call("removal of", loc[0], loc[1], "delete_objects", Delete=batch)


def replace_tree(src: Any, dst: Any) -> None:
    """Moves a directory (objects: server-side copies, the source's `metadata.json` removed
    first so that no moment shows two complete checkpoints, then the rest of the source)."""
    s, d = split(src), split(dst)
    if s is None or d is None:
        os.replace(src, dst)
        return
    prefix = _dir_prefix(s[1])
    keys = [o["Key"] for o in _list(s[0], prefix)[0]]
    for k in sorted(keys, key=lambda k: k.endswith("/metadata.json")):  # the marker last
        target = d[1] + "/" + k[len(prefix) :]
        src_obj = {"Bucket": s[0], "Key": k}
        _call("copy to", d[0], target, "copy_object", Key=target, CopySource=src_obj)
    remove(os.path.join(os.fspath(src), "metadata.json"))
    remove_tree(src)


class _ObjectFile(io.RawIOBase):
    """A seekable read-only object: each read is one ranged GET."""

    def __init__(self, path: Any) -> None:
        self._path, self._pos = path, 0
        self._bucket, self._key = split(path) or ("", "")
        head = _call("lookup of", self._bucket, self._key, "head_object", Key=self._key)
        self.size = int(head["ContentLength"])

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = max(0, (0, self._pos, self.size)[whence] + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, b: Any) -> int:
        n = min(len(b), self.size - self._pos)
        if n <= 0:
            return 0
        out = np.frombuffer(b, dtype=np.uint8)[:n]
        read_range(self._path, self._pos, out)
        self._pos += n
        return n


def open_read(path: Any) -> io.BufferedIOBase:
    """A file opened for reading (an object: read by ranged GETs of 8 MiB and more)."""
    if split(path) is None:
        return open(path, "rb")
    return io.BufferedReader(_ObjectFile(path), 8 * _MB)


def stat(path: Any) -> Tuple[int, float]:
    """`(bytes, newest modification time)` of an object, or of every object under a prefix."""
    bucket, key = split(path) or ("", "")
    try:
        head = _call("lookup of", bucket, key, "head_object", Key=key)
        return int(head["ContentLength"]), head["LastModified"].timestamp()
    except FileNotFoundError:
        pass
    r = _list(bucket, _dir_prefix(key))[0]
    return sum(o["Size"] for o in r), max((o["LastModified"].timestamp() for o in r), default=0.0)
