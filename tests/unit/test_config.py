from __future__ import annotations

import pytest

from chronomq.config import BrokerConfig, ConfigError, parse_delay_levels, parse_properties


def test_default_levels() -> None:
    levels = BrokerConfig().delay_levels_ms
    assert len(levels) == 18 and levels[0] == 1000 and levels[-1] == 7_200_000


def test_level_units() -> None:
    assert parse_delay_levels("100ms 2s 3m 1h 1d") == [100, 2000, 180_000, 3_600_000, 86_400_000]
    for bad in ("", "5x", "s", "-1s", "0s"):
        with pytest.raises(ConfigError):
            parse_delay_levels(bad)


def test_properties_file(tmp_path) -> None:
    conf = tmp_path / "broker.conf"
    conf.write_text("# comment\nbrokerName = broker-b\nlistenPort=10915\nflushDiskType: SYNC_FLUSH\n"
                    "autoCreateTopicEnable=false\nmessageDelayLevel=1s 2s \\\n 3s\nmysteryKey=1\n")
    cfg, warnings = BrokerConfig.load(conf)
    assert cfg.brokerName == "broker-b" and cfg.listenPort == 10915 and cfg.sync_flush
    assert cfg.autoCreateTopicEnable is False
    assert cfg.delay_levels_ms == [1000, 2000, 3000]
    assert warnings == ["unknown configuration key 'mysteryKey' ignored"]


@pytest.mark.parametrize("key,value,match", [
    ("listenPort", "abc", "not an integer"),
    ("flushDiskType", "SOMETIMES", "ASYNC_FLUSH or SYNC_FLUSH"),
    ("autoCreateTopicEnable", "maybe", "boolean"),
    ("deleteWhen", "25", "deleteWhen"),
    ("mappedFileSizeConsumeQueue", "21", "multiple of 20"),
    ("messageDelayLevel", "1s 2q", "messageDelayLevel"),
    ("metricsPort", "-2", "metricsPort: -2 must be -1"),
    ("namesrvMetricsPort", "65536", "namesrvMetricsPort: 65536 must be -1"),
])
def test_bad_values_refused(key: str, value: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        BrokerConfig().apply({key: value})


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        BrokerConfig.load("/nonexistent/broker.conf")


def test_parse_properties_edge_cases() -> None:
    assert parse_properties("a=1\n!c\n  b : 2 \nc\n") == {"a": "1", "b": "2", "c": ""}


def test_timer_keys_are_known_and_typed() -> None:
    warnings = BrokerConfig().apply({"timerMaxDelaySec": "86400", "timerPrecisionMs": "100"})
    assert warnings == []
    with pytest.raises(ConfigError, match="timerFlushIntervalMs"):
        BrokerConfig().apply({"timerFlushIntervalMs": "soon"})


def test_connection_limit_keys_have_rocketmq_defaults_and_are_checked() -> None:
    cfg = BrokerConfig()
    assert (cfg.serverChannelMaxIdleTimeSeconds, cfg.frameMaxLength) == (120, 16 * 1024 * 1024)
    assert BrokerConfig().apply({"serverMaxConnections": "0", "serverFrameReadTimeoutMillis": "0"}) == []
    for key, value, match in [
        ("frameMaxLength", "1048576", "maxMessageSize"),
        ("serverChannelMaxIdleTimeSeconds", "-1", "0 \\(no limit\\) or positive"),
        ("serverMaxConnectionsPerIp", "-5", "serverMaxConnectionsPerIp"),
        ("serverMaxBufferedFrameBytes", "1024", "at least frameMaxLength"),
        ("writeBufferLowWaterMark", "65536", "low < high"),
    ]:
        with pytest.raises(ConfigError, match=match):
            BrokerConfig().apply({key: value})


def test_the_authentication_secrets_are_not_in_the_repr() -> None:
    cfg = BrokerConfig()
    cfg.apply({"initAuthenticationUser": '{"username":"root","password":"pw-not-shown"}',
               "innerClientAuthenticationCredentials": '{"accessKey":"inner","secretKey":"sk-not-shown"}'})
    assert "pw-not-shown" in cfg.initAuthenticationUser
    assert "pw-not-shown" not in repr(cfg) and "sk-not-shown" not in repr(cfg)
