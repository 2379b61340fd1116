import pickle

import pytest

from s3ckpt import S3Config, S3StorageReader, S3StorageWriter
from s3ckpt.config import S3URI, make_config
from s3ckpt.errors import ConfigError, InvalidURIError


@pytest.mark.parametrize(
    "uri",
    ["/tmp/ckpt", "gs://bucket/x", "s3://", "s3://Bad_Bucket/x", "s3://b/x", "", None],
)
def test_invalid_uris_raise_invalid_uri_error(uri):
    with pytest.raises(InvalidURIError):
        S3URI.parse(uri)


def test_bucket_only_uri_is_refused_for_a_checkpoint():
    with pytest.raises(InvalidURIError, match="prefix"):
        S3StorageWriter("s3://bucket")
    assert S3URI.parse("s3://bucket", require_prefix=False).prefix == ""


def test_uri_parsing_and_keys():
    uri = S3URI.parse("s3://my-bucket/run 1/étape-100/")
    assert (uri.bucket, uri.prefix) == ("my-bucket", "run 1/étape-100")
    assert uri.key("manifest.json") == "run 1/étape-100/manifest.json"
    assert str(uri) == "s3://my-bucket/run 1/étape-100"


@pytest.mark.parametrize(
    "options",
    [
        {"endpoint_url": "flashblade:9000"},
        {"part_size": 1024},
        {"max_concurrency": 0},
        {"access_key_id": "only-half"},
        {"addressing_style": "sideways"},
        {"retry_base_delay_s": 0},
        {"no_such_option": 1},
    ],
)
def test_bad_options_raise_config_error(options):
    with pytest.raises(ConfigError):
        make_config(None, **options)


def test_secrets_never_appear_in_repr_and_everything_pickles():
    config = S3Config(
        endpoint_url="http://127.0.0.1:9",
        access_key_id="AKIDEXAMPLE",
        secret_access_key="SECRETSECRET",
    )
    writer = S3StorageWriter("s3://bucket/run/step-1", config=config)
    reader = S3StorageReader("s3://bucket/run/step-1", config=config)
    for obj in (config, writer, reader):
        assert "SECRETSECRET" not in repr(obj)
        assert "AKIDEXAMPLE" not in repr(obj)
        clone = pickle.loads(pickle.dumps(obj))
        assert (clone if isinstance(clone, S3Config) else clone.config) == config


def test_keyword_options_override_the_config():
    writer = S3StorageWriter(
        "s3://bucket/x", config=S3Config(max_concurrency=4), endpoint_url="https://fb.example:443"
    )
    assert writer.config.max_concurrency == 4
    assert writer.config.endpoint_url == "https://fb.example:443"
    assert writer.config.addressing_style == "path"
