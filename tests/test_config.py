"""SyncConfig: impossible settings are refused with a message that names the setting."""

from __future__ import annotations

import pytest

from mpsync.config import ConfigError, SyncConfig, parse_float_list


def test_defaults_are_valid_bsp_on_the_ring():
    cfg = SyncConfig.from_options(env={})
    assert (cfg.policy, cfg.topology, cfg.server) == ("bsp", "ring", "dedicated")


def test_a_policy_without_a_topology_runs_on_its_own_default():
    # The registry's default topology, the same one mpsync train and the job scripts pick.
    assert SyncConfig.from_options(env={}, policy="asp").topology == "ps"
    assert SyncConfig.from_options(env={}, policy="esync").topology == "ring"


@pytest.mark.parametrize("options, named", [
    ({"policy": "gossip"}, "unknown policy 'gossip'"),
    ({"topology": "mesh"}, "unknown topology 'mesh'"),
    ({"backend": "tcp"}, "unknown backend 'tcp'"),
    ({"server": "remote"}, "unknown server 'remote'"),
    ({"policy": "ssp", "topology": "ring"}, "policy='ssp' needs a central copy"),
    ({"policy": "dssp", "topology": "ring"}, "runs only on topology='ps'"),
    ({"policy": "asp", "topology": "ring"}, "policy='asp'"),
    ({"policy": "osp", "topology": "ps"}, "policy='osp' runs only on topology='ring'"),
    ({"staleness_low": 5, "staleness_high": 2}, "s_L=5 > s_U=2"),
    ({"lookahead": 0}, "lookahead R must be an integer >= 1"),
    ({"lookahead": 2.5}, "lookahead R must be an integer"),
    ({"epsilon": -0.1}, "epsilon"),
    ({"epsilon": 0.0}, "epsilon"),
    ({"staleness": -1}, "staleness must be an integer >= 0"),
    ({"osp_ics_max_fraction": 0.9}, "osp_ics_max_fraction"),
    ({"deadline": 0}, "deadline"),
    ({"zipline_variant": "fast"}, "unknown zipline_variant 'fast'"),
    ({"no_such_option": 1}, "unknown option 'no_such_option'"),
])
def test_impossible_settings_are_rejected_naming_the_setting(options, named):
    with pytest.raises(ConfigError) as info:
        SyncConfig.from_options(env={}, **options)
    assert named in str(info.value)
    assert "\n" not in str(info.value)


def test_environment_is_read_and_explicit_options_win():
    env = {"MPSYNC_POLICY": "ssp", "MPSYNC_TOPOLOGY": "ps", "MPSYNC_STALENESS": "7",
           "MPSYNC_ESYNC_DELAYED_ACK": "true", "MPSYNC_EPSILON": "0.5"}
    cfg = SyncConfig.from_options(env=env)
    assert (cfg.policy, cfg.topology, cfg.staleness, cfg.esync_delayed_ack, cfg.epsilon) == \
        ("ssp", "ps", 7, True, 0.5)
    assert SyncConfig.from_options(env=env, staleness=2).staleness == 2


def test_a_malformed_environment_value_names_the_variable():
    with pytest.raises(ConfigError, match="STALENESS"):
        SyncConfig.from_options(env={"MPSYNC_STALENESS": "three"})


def test_float_lists():
    assert parse_float_list("slowdown", "1,1,2,4", length=4) == [1.0, 1.0, 2.0, 4.0]
    with pytest.raises(ConfigError, match=r"slowdown: 3 values for 4 workers"):
        parse_float_list("slowdown", "1,2,4", length=4)
    with pytest.raises(ConfigError, match="slowdown: expected comma-separated numbers"):
        parse_float_list("slowdown", "1,x", length=2)
