"""FrontDoor's environment (cluster/cli/front_door.py): Serve's proxy checks get room on a busy
node, a user's own value of any variable wins, and a local cluster gets private HAProxy ports."""

from __future__ import annotations

from splitserve.cluster.cli.front_door import PROXY_CHECK_TIMEOUTS, FrontDoor


def test_proxy_checks_get_room_and_the_users_values_win(monkeypatch):
    joining = FrontDoor(local=False)
    env = joining.environment()
    for key, value in PROXY_CHECK_TIMEOUTS.items():
        assert env[key] == value and float(value) > 5.0  # Ray's default readiness check is 5 s
    assert joining.controller_options(env) == {"runtime_env": {"env_vars": env}}  # joining: via the controller
    monkeypatch.setenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "90")
    assert FrontDoor(local=False).environment()["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"] == "90"


def test_a_local_cluster_gets_private_haproxy_ports_and_folder():
    door = FrontDoor(local=True)
    try:
        env = door.environment()
        ports = {env[k] for k in ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT")}
        assert "8404" not in ports and "9101" not in ports and len(ports) == 2
        assert env["RAY_SERVE_HAPROXY_CONFIG_FILE_LOC"].startswith(door.state_dir)
        assert door.controller_options(env) is None  # local: this process's environment
    finally:
        door.cleanup()
