"""Remote URI rules: what hf:// and s3:// name, default model ids, and that no URI carrying a secret is
accepted (the error shows it redacted)."""

from __future__ import annotations

import pytest

from mergepipe.errors import StorageError
from mergepipe.storage.registry import canonical_uri
from mergepipe.storage.uris import HfRef, parse_hf, redact, remote_model_name, split_s3


def test_hub_uris_map_to_resolve_urls():
    assert parse_hf("hf://Qwen/Qwen3-0.6B") == HfRef("Qwen/Qwen3-0.6B", "main", "")
    ref = parse_hf("hf://org/model@v1.0/sub/dir/")
    assert ref == HfRef("org/model", "v1.0", "sub/dir")
    assert ref.base_url("http://127.0.0.1:9/") == "http://127.0.0.1:9/org/model/resolve/v1.0/sub/dir/"
    # a revision with slashes is written %-encoded (else the rest is a subfolder)
    assert parse_hf("hf://org/m@refs%2Fpr%2F1").base_url("https://hub") == "https://hub/org/m/resolve/refs%2Fpr%2F1/"
    assert parse_hf("hf://org/m@refs/pr/1") == HfRef("org/m", "refs", "pr/1")
    with pytest.raises(StorageError, match=r"^hf://model: not a Hub URI; expected hf://org/model\[@revision\]"):
        parse_hf("hf://model")


def test_s3_uris_split_into_bucket_and_prefix():
    assert split_s3("s3://bucket/a/b/") == ("bucket", "a/b")
    assert split_s3("s3://bucket") == ("bucket", "")
    with pytest.raises(StorageError, match=r"^s3://: an S3 URI names a bucket"):
        split_s3("s3://")


def test_default_model_ids_of_remote_uris():
    assert [remote_model_name(u) for u in ("hf://org/math@main", "http://h:1/org/code/resolve/main/",
                                          "s3://b/models/chat", "https://h/x/model.safetensors")] == \
        ["math", "code", "chat", "model"]


@pytest.mark.parametrize("uri, shown", [
    ("https://bob:hunter2@host/models/x", "https://***@host/models/x"),
    ("https://host/models/x?X-Amz-Signature=hunter2", "https://host/models/x?***"),
    ("s3://bucket/x#hunter2", "s3://bucket/x#***"),
])
def test_uris_carrying_secrets_are_refused_redacted(uri, shown):
    assert redact(uri) == shown
    with pytest.raises(StorageError) as err:
        canonical_uri(uri)
    assert str(err.value).startswith(f"{shown}: a remote URI must not carry credentials")
    assert "hunter2" not in str(err.value)


def test_canonical_remote_uris():
    assert canonical_uri("HF://org/model@main/") == "hf://org/model@main"
    assert canonical_uri("s3://bucket/prefix/") == "s3://bucket/prefix"
