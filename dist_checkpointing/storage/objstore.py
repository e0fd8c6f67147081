"""S3-compatible object stores (`s3://`, `msc://`) behind this package's file interface: a
checkpoint is a key prefix; the helpers take local and object paths alike. The client is
boto3 (extra `[s3]`), set up from the AWS environment and files or the path's MSC profile."""

from __future__ import annotations

import bisect
import contextlib
import logging
import os
import re
import shutil
import threading
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np

from ..errors import CheckpointCorruptedError, CheckpointingException
from . import msc

__all__ = ["ObjectWriter", "split", "read_range", "prefetching", "read_object", "put_object"]
__all__ += ["stat", "exists", "is_file", "is_dir", "listdir", "makedirs", "remove"]
__all__ += ["remove_tree", "replace_tree"]

logger = logging.getLogger(__name__)

_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+):(?:/+(.*))?", re.S)  # `s3://` is `s3:`
_MB = 1 << 20
_ENV = "AWS_ENDPOINT_URL AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY AWS_PROFILE MSC_CONFIG".split()
_UNKEYED = ("head_bucket", "list_objects_v2", "delete_objects")
_clients: Dict[Tuple[Any, ...], Any] = {}  # thread-safe clients by process and settings
_shared: List[Any] = []  # [request thread pool, part budget], made on first use
_lock = threading.Lock()
_local = threading.local()
Loc = Tuple[str, str, Optional[str]]  # bucket, key, MSC profile (None: the AWS environment)
_NOWHERE: Loc = ("", "", None)  # for mypy: `split` of an object path is never None


def part_size() -> int:
    """Bytes per uploaded part and per ranged GET (`DIST_CKPT_S3_PART_MB`, >= 5 MiB)."""
    return max(5, int(os.environ.get("DIST_CKPT_S3_PART_MB", "16"))) * _MB


def concurrency() -> int:
    """Requests in flight per rank (`DIST_CKPT_S3_CONCURRENCY`)."""
    return max(1, int(os.environ.get("DIST_CKPT_S3_CONCURRENCY", "8")))


def split(path: Any) -> Optional[Loc]:
    """The `Loc` of an object path (`Path("s3://b/k")` prints as `s3:/b/k`: the same), None for
    a local one. Any other scheme is refused (`CheckpointingException`), never made local."""
    text = os.fspath(path)
    m = _SCHEME.fullmatch(text)
    if m is None:
        return None
    scheme, (bucket, _, key) = m[1].lower(), (m[2] or "").partition("/")
    if scheme == "msc":  # msc://profile/key
        store, base, _ = msc.profile(bucket, f"msc://{m[2] or ''}")
        return store, f"{base}/{key}".strip("/"), bucket
    if scheme != "s3" or not bucket:
        why = f"unsupported URL scheme {m[1]!r}" if scheme != "s3" else "no bucket in the path"
        raise CheckpointingException(f"{text}: {why} (supported: local, s3://, msc:// paths)")
    return bucket, key.strip("/"), None


def _client(name: Optional[str]) -> Any:
    which = (os.getpid(), name, *map(os.environ.get, _ENV))  # forked workers, new settings
    with _lock:
        if which not in _clients:
            try:
                import boto3
                from botocore.config import Config
            except ImportError as e:
                hint = "pip install 'dist_checkpointing[s3]'"
                raise CheckpointingException(f"s3:// paths need boto3: {hint}") from e
            kw = dict(msc.profile(name)[2]) if name is not None else {}
            attempts = int(os.environ.get("AWS_MAX_ATTEMPTS", 5))
            retries = {"mode": "standard", "max_attempts": attempts}
            pool = 2 * concurrency() + 4
            config = Config(retries=retries, max_pool_connections=pool, s3=kw.pop("s3", None))
            session = boto3.session.Session(profile_name=kw.pop("profile_name", None))
            _clients[which] = session.client("s3", config=config, **kw)
        return _clients[which]


def _call(what: str, loc: Loc, method: str, **kw: Any) -> Any:
    """One request. Errors: FileNotFoundError (no object), EOFError (range past its end), else
    a CheckpointingException naming the object as the user did, its bucket and endpoint."""
    client = _client(loc[2])
    if method not in _UNKEYED:
        kw.setdefault("Key", loc[1])
    try:
        return getattr(client, method)(Bucket=loc[0], **kw)
    except Exception as e:
        code = str(getattr(e, "response", {}).get("Error", {}).get("Code", ""))
        where = f"s3://{loc[0]}/{loc[1]} at {client.meta.endpoint_url}"
        if loc[2] is not None:
            where = f"msc://{loc[2]}/{loc[1][len(msc.profile(loc[2])[1]) :].lstrip('/')} ({where})"
        if code == "NoSuchBucket" or (code == "404" and method == "head_bucket"):
            raise CheckpointingException(f"{what} {where}: bucket {loc[0]!r} does not exist") from e
        if code in ("NoSuchKey", "404", "NoSuchUpload"):
            raise FileNotFoundError(f"{where}: no such object") from e
        if code in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
            raise FileExistsError(f"{where}: the object exists (a conditional write)") from e
        if code == "InvalidRange":
            raise EOFError(f"{where}: range past the end of the object") from e
        raise CheckpointingException(f"{what} {where} failed: {type(e).__name__}: {e}") from e


def _pool_and_budget() -> Tuple[ThreadPoolExecutor, threading.BoundedSemaphore]:
    with _lock:
        if not _shared:  # on first use, never at import
            n = concurrency()
            _shared[:] = [ThreadPoolExecutor(n, "dc-s3"), threading.BoundedSemaphore(2 * n)]
        return _shared[0], _shared[1]


class ObjectWriter:
    """`FileWriter`'s interface: an object of `size` bytes streamed as a parallel multipart
    upload, which appears only when `finish` completes it."""

    direct = False
    _buf: Optional[bytearray] = None  # the part being filled
    _upload_id: Optional[str] = None

    def __init__(self, path: Any, size: int, *args: Any, **kwargs: Any) -> None:
        self.path, self.size, self._loc = os.fspath(path), size, split(path) or _NOWHERE
        self._part, self._fill, self._pos = part_size(), 0, 0
        self._parts: List[Future] = []

    def write(self, view: memoryview, offset: int) -> None:
        """Appends `view` (bytes past `size` are padding, dropped) at `offset`."""
        if offset != self._pos:
            raise CheckpointingException(f"{self.path}: write at {offset}, expected {self._pos}")
        data = memoryview(view).cast("B")[: max(0, self.size - offset)]
        self._pos += len(data)
        while len(data):
            if self._buf is None:
                _pool_and_budget()[1].acquire()  # blocks while the rank's parts are in use
                self._buf = bytearray(self._part)
            n = min(len(data), self._part - self._fill)
            memoryview(self._buf)[self._fill : self._fill + n] = data[:n]  # no temporary copy
            self._fill, data = self._fill + n, data[n:]
            if self._fill == self._part and (len(data) or self._pos < self.size):
                self._send()

    def _send(self) -> None:
        """Hands the part buffer to an upload thread, which returns it to the budget."""
        if self._upload_id is None:
            self._upload_id = _call("upload to", self._loc, "create_multipart_upload")["UploadId"]
        assert self._buf is not None
        held, number, upload_id = [self._buf], len(self._parts) + 1, self._upload_id
        del held[0][self._fill :]  # the last part: shrunk in place, not copied
        self._buf, self._fill = None, 0
        pool, budget = _pool_and_budget()

        def upload() -> Dict[str, Any]:
            # the part is freed before its budget is returned: no reference outlives the call
            # (an error's frames are cleared), else a new part would join it in memory
            kw = {"UploadId": upload_id, "PartNumber": number, "Body": held.pop()}
            try:
                tag = _call("upload to", self._loc, "upload_part", **kw)["ETag"]
                return {"PartNumber": number, "ETag": tag}
            except BaseException as e:
                for x in (e, e.__cause__):
                    traceback.clear_frames(x.__traceback__ if x is not None else None)
                raise
            finally:
                kw.clear()
                budget.release()

        self._parts.append(pool.submit(upload))

    def finish(self) -> None:
        """Completes the object (one PUT if it fits in a part), or aborts the upload and raises."""
        try:
            if self._pos != self.size:
                raise CheckpointingException(f"{self.path}: {self._pos} of {self.size} bytes")
            if self._upload_id is None:
                body = bytes(self._buf[: self._fill]) if self._buf is not None else b""
                self.abort()  # returns the buffer
                return put_object(self.path, body)
            self._send()
            done = {"Parts": [f.result() for f in self._parts]}
            kw = {"UploadId": self._upload_id, "MultipartUpload": done}
            _call("upload to", self._loc, "complete_multipart_upload", **kw)
            self._upload_id = None
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Abandons the upload after a failure: nothing of it becomes visible."""
        if self._buf is not None:
            self._buf = None
            _pool_and_budget()[1].release()
        for f in self._parts:
            f.exception()  # every part's thread has returned its buffer
        upload_id, self._upload_id = self._upload_id, None
        if upload_id is not None:
            try:
                _call("abort of", self._loc, "abort_multipart_upload", UploadId=upload_id)
            except Exception as e:  # the store's lifecycle rules remove it later
                logger.warning("could not abort the upload of %s: %s", self.path, e)


def read_range(
    path: Any, offset: int, out: np.ndarray, progress: Optional[Callable[[int], None]] = None
) -> None:
    """Fills `out` (flat uint8) from `offset` of an object (CheckpointCorruptedError if it is
    shorter) with parallel GETs of 2/3 to 3/2 of a part, or from `prefetching` memory."""
    loc, report = split(path) or _NOWHERE, progress or (lambda n: None)
    step = max(1, -(-out.size // max(1, round(out.size / part_size()))))
    find = getattr(_local, "find", None)
    held = find(loc, offset, out.size) if find is not None else None
    if held is not None:
        out[:] = held
        return report(out.size)

    def get(start: int) -> None:
        n = min(step, out.size - start)
        rng = f"bytes={offset + start}-{offset + start + n - 1}"
        try:
            got = _call("read of", loc, "get_object", Range=rng)["Body"].read()
        except (FileNotFoundError, EOFError) as e:
            raise CheckpointCorruptedError(str(e)) from e
        if len(got) != n:
            raise CheckpointCorruptedError(f"{path}: short read at offset {offset + start}")
        out[start : start + n] = np.frombuffer(got, dtype=np.uint8)

    starts = range(0, out.size, step)
    jobs = [_pool_and_budget()[0].submit(get, s) for s in starts] if len(starts) > 1 else []
    for i, s in enumerate(starts):
        jobs[i].result() if jobs else get(s)  # in order: `progress` sees the prefix grow
        report(min(out.size, s + step))


@contextlib.contextmanager
def prefetching(path: Any, ranges: List[Tuple[int, int]]) -> Iterator[None]:
    """Reads this thread makes within `ranges` (offset, length) of an object come from memory:
    each range of up to `concurrency x part size / 2` (two are held) is fetched whole while
    the one before it is read, so the store always has work."""
    loc, cap = split(path), concurrency() * part_size() // 2
    spans = sorted(r for r in ranges if 0 < r[1] <= cap)
    pool = ThreadPoolExecutor(1, "dc-s3-ahead")
    got: Dict[int, Future] = {}  # range index -> its fetch

    def fetch(i: int) -> np.ndarray:
        data = np.empty(spans[i][1], dtype=np.uint8)
        read_range(path, spans[i][0], data)  # in the fetching thread: from the store
        return data

    def find(at: Loc, offset: int, n: int) -> Optional[np.ndarray]:
        i = bisect.bisect_right(spans, (offset, 1 << 62)) - 1
        if at != loc or i < 0 or offset + n > sum(spans[i]):
            return None
        for k in [k for k in got if k < i]:
            del got[k]  # those passed are freed
        for k in (i, i + 1)[: len(spans) - i]:
            got[k] = got.get(k) or pool.submit(fetch, k)
        return got[i].result()[offset - spans[i][0] :][:n]

    _local.find = find if loc is not None else None
    try:
        yield
    finally:
        _local.find = None
        pool.shutdown(wait=True, cancel_futures=True)


def read_object(path: Any, limit: int) -> Optional[bytes]:
    """An object's first `limit` + 1 bytes, or None when it does not exist."""
    try:
        got = _call("read of", split(path) or _NOWHERE, "get_object", Range=f"bytes=0-{limit}")
        return got["Body"].read()
    except FileNotFoundError:
        return None
    except EOFError:  # a range of an empty object
        return b""


def put_object(path: Any, data: bytes, *, new: bool = False) -> None:
    """Writes a whole object in one PUT (readers see the old object or all of the new one).

    Raises:
        FileExistsError: with `new` (a PUT with `If-None-Match: *`), the object exists (or
            another writer's conditional PUT of it won).
    """
    only_if_new = {"IfNoneMatch": "*"} if new else {}
    _call("upload to", split(path) or _NOWHERE, "put_object", Body=data, **only_if_new)


def _list(loc: Loc, delimiter: str = "") -> Tuple[List[Any], List[str]]:
    """`(objects: Key, Size, LastModified; sub-prefixes)` under the prefix `key/`."""
    found: Tuple[List[Any], List[str]] = ([], [])
    kw = {"Prefix": f"{loc[1]}/" if loc[1] else "", "Delimiter": delimiter}
    while True:
        r = _call("listing of", loc, "list_objects_v2", **kw)
        found[0].extend(r.get("Contents", []))
        found[1].extend(p["Prefix"] for p in r.get("CommonPrefixes", []))
        if not r.get("IsTruncated"):
            return found
        kw["ContinuationToken"] = r["NextContinuationToken"]


def stat(path: Any) -> Tuple[int, float]:
    """`(bytes, newest modification time)` of an object, else of the objects under a prefix."""
    loc = split(path) or _NOWHERE
    try:
        head = _call("lookup of", loc, "head_object")
        return int(head["ContentLength"]), head["LastModified"].timestamp()
    except FileNotFoundError:
        found = _list(loc)[0]
    if not found:
        raise FileNotFoundError(f"{path}: no such object or prefix")
    return sum(o["Size"] for o in found), max(o["LastModified"].timestamp() for o in found)


def is_file(path: Any) -> bool:
    """Whether a file (an object) exists at `path`."""
    loc = split(path)
    try:
        return os.path.isfile(path) if loc is None else bool(_call("lookup of", loc, "head_object"))
    except FileNotFoundError:
        return False


def is_dir(path: Any) -> bool:
    """Whether `path` is a directory (a prefix with objects under it)."""
    loc = split(path)
    return os.path.isdir(path) if loc is None else any(_list(loc, "/"))


def exists(path: Any) -> bool:
    """Whether a file or directory exists at `path`."""
    return is_file(path) or is_dir(path)


def listdir(path: Any) -> List[str]:
    """Names directly under a directory (FileNotFoundError if there is none)."""
    loc = split(path)
    if loc is None:
        return os.listdir(path)
    objects, subs = _list(loc, "/")
    cut = len(loc[1]) + 1 if loc[1] else 0
    names = {k[cut:].rstrip("/") for k in subs + [o["Key"] for o in objects]}
    if not names:
        raise FileNotFoundError(f"{path}: no objects under this prefix")
    return sorted(names)


def makedirs(path: Any) -> None:
    """Creates a directory; for a prefix, raises unless its bucket can be reached."""
    loc = split(path)
    if loc is None:
        return os.makedirs(path, exist_ok=True)
    _call("access to", loc, "head_bucket")


def remove(path: Any) -> None:
    """Removes a file (an object) if it exists."""
    loc = split(path)
    if loc is not None:
        _call("removal of", loc, "delete_object")
    elif os.path.lexists(path):
        os.remove(path)


def remove_tree(path: Any) -> None:
    """Removes a directory and everything under it (a prefix and its objects)."""
    loc = split(path)
    if loc is None:
        return shutil.rmtree(path, ignore_errors=True)
    keys = [{"Key": o["Key"]} for o in _list(loc)[0]]
    for i in range(0, len(keys), 1000):
        batch = {"Objects": keys[i : i + 1000], "Quiet": True}
        _call("removal of", loc, "delete_objects", Delete=batch)


def replace_tree(src: Any, dst: Any) -> None:
    """Moves a directory. Objects: server-side copies, the commit marker `metadata.json`
    copied last and removed from the source first, so no moment shows two checkpoints."""
    s, d = split(src), split(dst)
    if s is None or d is None:
        return os.replace(src, dst)
    keys = sorted((o["Key"] for o in _list(s)[0]), key=lambda k: k.endswith("/metadata.json"))
    for k in keys:
        source = {"Bucket": s[0], "Key": k}
        _call("copy to", (d[0], d[1] + k[len(s[1]) :], d[2]), "copy_object", CopySource=source)
    remove(os.path.join(os.fspath(src), "metadata.json"))
    remove_tree(src)
