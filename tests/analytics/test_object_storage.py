"""The archive and the analytics' run folders on S3 (docs/analytics.md, "Running it elsewhere"):
MQ_ARCHIVE_DIR=s3a://bucket/prefix, written and read with pyarrow's S3 client against a local
S3-compatible server (moto's, from PyPI), credentials and endpoint from the AWS SDK's own
environment variables as a deployment would give them.

Spark's side of S3 (hadoop-aws's s3a:// filesystem) needs jars that the pyspark package does not
ship and this machine cannot fetch, so it is not run here: the analysis below is one whose
archived days are reduced in this process (a folder's later run, a few megabytes changed).
"""

import io
import json
import logging

import boto3
import pytest
from django.core.management import call_command
from moto.server import ThreadedMotoServer

from analytics import stored
from queues.models import Message
from tests.analytics import history
from tests.support import history_rows

pytestmark = pytest.mark.django_db

BUCKET = "mq-archive"


@pytest.fixture
def s3(monkeypatch):
    """A local S3 server with an empty bucket; the AWS SDK's variables point at it."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    for name, value in {
        "AWS_ACCESS_KEY_ID": "mq-test",
        "AWS_SECRET_ACCESS_KEY": "mq-test-secret",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
    }.items():
        monkeypatch.setenv(name, value)
    client = boto3.client("s3")
    client.create_bucket(Bucket=BUCKET)
    yield client
    server.stop()


def keys(client, prefix):
    """The objects under `prefix`, less the empty folder markers pyarrow makes."""
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return sorted(o["Key"] for page in pages for o in page.get("Contents", []) if not o["Key"].endswith("/"))


def test_the_archive_and_the_analytics_live_on_s3(s3, settings, make_queue, db_queue, logger, peer):
    settings.MQ_ARCHIVE_DIR = f"s3a://{BUCKET}/mq"  # Spark's scheme; pyarrow's s3:// underneath
    settings.MQ_ANALYTICS_LOCAL_BYTES = 64 << 20
    history_rows.two_queues_of_history(db_queue, make_queue("network"), logger, peer)
    expected = history_rows.expected_events()
    # The beat's first run, before anything is archived: no Spark, a run folder on S3
    call_command("analyze", stdout=io.StringIO())

    # When the settled history older than five days moves to the bucket, and is compacted
    call_command("archive", "--older-than-days", "5", "--json", stdout=(moved := io.StringIO()))
    call_command("compactarchive", stdout=io.StringIO())
    out = io.StringIO()
    call_command("analyze", "--json", stdout=out)

    # Then the bucket holds the Hive layout, whole files only (no temporary name left behind)
    archived = keys(s3, "mq/messages/") + keys(s3, "mq/deliveries/")
    assert json.loads(moved.getvalue())["messages"] > 0 and Message.objects.count() < 24
    assert archived and all(
        k.split("/")[2].startswith("queue=") and k.split("/")[3].startswith("day=") and k.endswith(".parquet")
        for k in archived
    )
    assert not [k for k in keys(s3, "mq/") if k.endswith(".tmp")]
    # ... the archived days were read back from it, and every figure is the rows' own
    run = stored.last_run()
    assert run.partitions_recomputed > 0 and not run.spark
    history.assert_figures(json.loads(out.getvalue()), expected)
    # ... and the run folders and the file naming the current one are in the bucket too
    current = s3.get_object(Bucket=BUCKET, Key="mq/_analytics/CURRENT")["Body"].read().decode().strip()
    assert current == run.run_id
    assert f"mq/_analytics/runs/{current}/manifest.json" in keys(s3, "mq/_analytics/runs/")
