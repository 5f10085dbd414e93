"""The one storage interface (ragkv.store.objects.Objects), held to one contract by both of its
implementations: a folder, and a real S3 server (SeaweedFS) through RemoteStore and its mirror.
What readers above the store rely on without asking which they have."""

from __future__ import annotations

import pytest

from ragkv.store.objects import FolderObjects, Objects
from ragkv.store.remote import RemoteStore, objects_at

pytestmark = pytest.mark.slow  # the S3 half starts a server


@pytest.fixture(params=["folder", "s3"])
def objects(request, tmp_path) -> Objects:
    if request.param == "folder":
        return objects_at(tmp_path / "store")
    s3 = request.getfixturevalue("s3_env")  # credentials and endpoint set, a fresh mirror
    assert s3
    return objects_at(f"s3://ragkv/objects-{tmp_path.name}")


def test_what_is_put_is_listed_read_and_deleted_whole(objects):
    assert objects.names("pending") == {} and objects.get("pending/a.json") is None
    objects.put("pending/a.json", b'{"a": 1}')
    objects.put("pending/b.hits.jsonl", b"x" * 300)
    assert objects.names("pending") == {"a.json": 8, "b.hits.jsonl": 300}
    assert objects.get("pending/a.json") == b'{"a": 1}'
    assert objects.fetch("pending/b.hits.jsonl").read_bytes() == b"x" * 300
    objects.delete("pending/a.json")
    objects.delete("pending/a.json")  # gone already: nothing to do
    assert objects.names("pending") == {"b.hits.jsonl": 300} and objects.get("pending/a.json") is None


def test_a_published_mirror_file_is_the_object_and_only_a_copy_leaves(objects):
    local = objects.mirror / "pending" / "c.safetensors"
    local.parent.mkdir(parents=True, exist_ok=True)
    local.write_bytes(b"kv" * 50)
    objects.publish("pending/c.safetensors")
    assert objects.names("pending") == {"c.safetensors": 100}
    assert objects.get("pending/c.safetensors") == b"kv" * 50
    # a bucket keeps no local copy once it holds the object; a folder's file is the object
    assert local.exists() == (not objects.shared)
    objects.drop_copy("pending/c.safetensors")  # a copy of what the store holds: never the object itself
    assert objects.get("pending/c.safetensors") == b"kv" * 50


def test_the_two_say_who_shares_them_and_name_themselves_as_the_user_did(tmp_path, s3_env):
    folder = objects_at(tmp_path / "f")
    bucket = objects_at("s3://ragkv/named")
    assert isinstance(folder, FolderObjects) and isinstance(bucket, RemoteStore)
    assert (folder.shared, bucket.shared) == (False, True)
    assert folder.uri == str(tmp_path / "f") and bucket.uri == "s3://ragkv/named"
