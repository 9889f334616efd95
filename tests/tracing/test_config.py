"""[tracing]: defaults, the standard OTEL_* variables as fallbacks, errors that name the key."""
from __future__ import annotations

import pytest

from pdd.config import ConfigError
from pdd.config_loader import load_cluster_config


def test_off_by_default():
    t = load_cluster_config(env={}).tracing
    assert (t.otlp_endpoint, t.service_name, t.sample_ratio, t.headers) == ("", "pdd", 1.0, ())


def test_the_standard_variables_fill_what_pdd_settings_leave_unset(tmp_path):
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_SERVICE_NAME": "llm",
           "OTEL_EXPORTER_OTLP_HEADERS": "Authorization=Bearer%20abc, x-tenant = t1"}
    t = load_cluster_config(env=env).tracing
    assert (t.otlp_endpoint, t.service_name) == ("http://127.0.0.1:4318", "llm")
    assert t.header_dict() == {"Authorization": "Bearer abc", "x-tenant": "t1"}
    conf = tmp_path / "c.toml"
    conf.write_text('[tracing]\notlp_endpoint = "http://collector:4318"\n')
    assert load_cluster_config(conf, env=env).tracing.otlp_endpoint == "http://collector:4318"
    # PDD_TRACING__* wins over both; empty turns tracing off.
    assert load_cluster_config(conf, env={**env, "PDD_TRACING__OTLP_ENDPOINT": ""}).tracing.otlp_endpoint == ""


@pytest.mark.parametrize("key, value, named", [
    ("OTLP_ENDPOINT", "127.0.0.1:4318", "tracing.otlp_endpoint"),
    ("SAMPLE_RATIO", "1.5", "tracing.sample_ratio"),
    ("SAMPLE_RATIO", "half", "tracing.sample_ratio"),
    ("HEADERS", "Authorization", "tracing.headers[0]"),
    ("HEADERS", "bad name=x", "tracing.headers[0]"),
    ("BATCH_SIZE", "0", "tracing.batch_size"),
    ("QUEUE_SIZE", "10", "tracing.queue_size"),
    ("EXPORT_TIMEOUT_S", "0", "tracing.export_timeout_s"),
    ("SERVICE_NAME", "", "tracing.service_name"),
])
def test_a_bad_value_is_refused_naming_its_key(key, value, named):
    with pytest.raises(ConfigError, match=rf"^PDD_TRACING__{key}: {named.replace('[', '.').replace(']', '.')}"):
        load_cluster_config(env={f"PDD_TRACING__{key}": value})


def test_pdd_admin_config_masks_the_headers():
    from pdd.admin.server import masked_config
    cfg = load_cluster_config(env={"PDD_TRACING__HEADERS": "Authorization=Bearer s3cret"})
    assert masked_config(cfg)["tracing"]["headers"] == ["***"]
