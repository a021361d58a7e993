"""The object store behind the bucket tier: the only module that imports its client,
``obstore`` (it releases the GIL for a whole transfer and takes fsspec's URLs).
Credentials and endpoint come from the standard environment (``AWS_*``) or the
client's files. ``Store`` speaks in keys relative to the URL's prefix and in buffers;
a client error becomes a ``RemoteError`` naming the URL, the key and what to do.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Iterator

from ..errors import RemoteAuthError, RemoteError


TAG = "ckptd-share"


def _client_options(url: str) -> dict[str, Any]:
    opts: dict[str, Any] = {"connect_timeout": "5s", "timeout": "300s"}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or ""
    if url.startswith("s3://") and endpoint.startswith("http://"):
        opts["allow_http"] = True
    return opts


class Store:
    """One bucket prefix. Thread-safe: the client is shared by every thread."""

    def __init__(self, url: str, *, part_bytes: int = 16 * 2**20, concurrency: int = 8) -> None:
        try:
            import obstore
            from obstore.store import from_url
        except ImportError:
            raise RemoteError(f"the remote tier {url!r} needs the obstore package: "
                              "pip install 'ckptd[remote]' (or pip install obstore)") from None

        self.url = url.rstrip("/")
        self.part_bytes = part_bytes
        self.concurrency = concurrency
        self._ob = obstore
        try:
            # object_store's own retries are kept short: the uploader retries with its own
            # backoff, forever, and a reader should hear of a dead server quickly
            self._store = from_url(self.url, client_options=_client_options(self.url), retry_config={
                "max_retries": 2, "retry_timeout": timedelta(seconds=20),
                "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=2),
                            "base": 2}})
        except Exception as exc:
            raise RemoteError(f"cannot use the remote tier {url!r}: {exc}; check [remote] url") from None

    def where(self, key: str) -> str:
        return f"{self.url}/{key}"

    def put_file(self, key: str, source: BinaryIO | Iterator[bytes], tag: str = "") -> None:
        """Upload an open local file, or its parts; larger than ``part_bytes``: a multipart
        upload of that part size, ``concurrency`` parts in flight (memory: part_bytes x
        concurrency). The object appears only when the whole upload completes. ``tag`` is
        kept with the object as user metadata (``tag_of`` reads it back)."""
        try:
            self._ob.put(self._store, key, source, chunk_size=self.part_bytes, max_concurrency=self.concurrency,
                         attributes={TAG: tag} if tag else None)
        except Exception as exc:
            raise self._error("uploading", key, exc) from None

    def put_bytes(self, key: str, data: bytes) -> None:
        try:
            self._ob.put(self._store, key, data, use_multipart=False)
        except Exception as exc:
            raise self._error("uploading", key, exc) from None

    def copy(self, src: str, dst: str) -> None:
        """Copy object ``src`` to ``dst`` inside the bucket (S3 CopyObject: no bytes pass
        through this host). A missing ``src`` is a FileNotFoundError."""
        try:
            self._ob.copy(self._store, src, dst)
        except FileNotFoundError:
            raise
        except Exception as exc:
            raise self._error("copying to", dst, exc) from None

    def tag_of(self, key: str) -> str | None:
        """The ``tag`` an object was uploaded with (None: none, or no such object)."""
        try:
            return self._ob.get(self._store, key, options={"head": True}).attributes.get(TAG)
        except FileNotFoundError:
            return None
        except Exception as exc:
            raise self._error("reading", key, exc) from None

    def delete(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        if not keys:
            return
        try:
            self._ob.delete(self._store, keys)
        except FileNotFoundError:
            pass
        except Exception as exc:
            raise self._error("deleting", keys[0], exc) from None

    def list(self, prefix: str) -> dict[str, int]:
        """Every object under ``prefix`` (a folder-like key ending in ``/``): key -> size."""
        try:
            out: dict[str, int] = {}
            for batch in self._ob.list(self._store, prefix):
                for meta in batch:
                    out[meta["path"]] = int(meta["size"])
            return out
        except Exception as exc:
            raise self._error("listing", prefix, exc) from None

    def get(self, key: str, limit: int) -> bytes:
        """A small object whole (a manifest); RemoteError beyond ``limit`` bytes."""
        try:
            result = self._ob.get(self._store, key)
            size = int(result.meta["size"])
            if size > limit:
                raise RemoteError(f"{self.where(key)} is {size} bytes, more than the {limit} allowed for it: it is not "
                                  "what ckptd uploaded there; remove it from the bucket, or point [remote] url "
                                  "at a prefix that only ckptd writes")
            return bytes(result.bytes())
        except FileNotFoundError:
            raise
        except RemoteError:
            raise
        except Exception as exc:
            raise self._error("reading", key, exc) from None

    def read_into(self, key: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the object's bytes at ``offset``: ``part_bytes`` ranges fetched
        at once (the client runs them in parallel), each copied to its place."""
        n = len(out)
        if n == 0:
            return
        starts = list(range(offset, offset + n, self.part_bytes))
        ends = [min(s + self.part_bytes, offset + n) for s in starts]
        try:
            pieces = self._ob.get_ranges(self._store, key, starts=starts, ends=ends)
        except FileNotFoundError:
            raise
        except Exception as exc:
            raise self._error("reading", key, exc) from None
        for start, end, piece in zip(starts, ends, pieces):
            view = memoryview(piece)
            if len(view) != end - start:
                raise RemoteError(f"{self.where(key)}: {len(view)} bytes came back for the range "
                                  f"{start}..{end}; the object is shorter than its manifest says")
            out[start - offset:end - offset] = view

    def download(self, key: str, path: Path) -> None:
        """Stream an object into a new local file (``path`` must not exist)."""
        with open(path, "xb") as fh:
            for chunk in self.stream(key):
                fh.write(chunk)

    def stream(self, key: str) -> Iterator[Any]:
        """An object's bytes in pieces of about ``part_bytes``, as they arrive."""
        try:
            yield from self._ob.get(self._store, key).stream(min_chunk_size=self.part_bytes)
        except (FileNotFoundError, FileExistsError):
            raise
        except Exception as exc:
            raise self._error("downloading", key, exc) from None

    def _error(self, doing: str, key: str, exc: BaseException) -> RemoteError:
        from obstore import exceptions as obx

        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        auth = isinstance(exc, (obx.PermissionDeniedError, obx.UnauthenticatedError)) or any(
            code in str(exc) for code in ("SignatureDoesNotMatch", "InvalidAccessKeyId", "AccessDenied"))
        if auth:
            return RemoteAuthError(
                f"the object store refused the credentials {doing} {self.where(key)}: {text}; set "
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or the client's config files) to a key it accepts")
        return RemoteError(f"{doing} {self.where(key)} failed: {text}; check that [remote] url names a bucket "
                           "this host can reach (AWS_ENDPOINT_URL for a server other than AWS)")
