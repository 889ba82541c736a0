"""The local Ray cluster starts on a machine where Ray has never run: Ray 2.5x turns token
authentication on for local clusters, and `ray start` does not create the token itself
(a fresh clone's `make test` failed there with AuthenticationError)."""

import importlib.metadata

import pytest

from gac_jax.rollout.ray_cluster import LocalRayCluster, _port_open


@pytest.mark.slow
def test_a_cluster_starts_where_no_token_exists_and_creates_one(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # Ray's default place is ~/.ray/auth_token.
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    with LocalRayCluster(num_cpus=1) as cluster:
        port = int(cluster.address.rsplit(":", 1)[1])
        assert _port_open(port)
    major, minor = (int(x) for x in importlib.metadata.version("ray").split(".")[:2])
    if (major, minor) >= (2, 60):  # Token authentication on by default: the token was made.
        assert (tmp_path / ".ray" / "auth_token").read_text().strip()
