"""`allowed_ips` (`--allow-ip`, `DLM_ALLOWED_IPS`): the deployment guides' access allow-list.
A client outside every listed network gets 403 `ip_not_allowed` on every route but the
probes; without the setting every address may call, as before."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from dlm.cli.server.app import create_app
from dlm.cli.server.config import load_config
from dlm.engine.errors import UsageError

# The app is built, not started: no model loads (its lifespan does not run without `with`).


def app(**flags: Any) -> Any:
    return create_app(load_config(flags=flags, environ={}))


@pytest.mark.parametrize(
    "client, allowed",
    [
        (("10.1.2.3", 5000), True),
        (("192.168.1.5", 5000), False),
        (("::1", 5000), True),
        (("::ffff:10.0.0.7", 5000), True),  # an IPv4 client on a dual-stack socket
        (("testclient", 5000), False),  # not an address at all
    ],
)
def test_only_listed_networks_reach_the_api_and_probes_stay_open(client: tuple[str, int], allowed: bool) -> None:
    http = TestClient(app(allowed_ips=["10.0.0.0/8", "::1"]), client=client)
    for path in ("/version", "/metrics", "/v1/models", "/openapi.json"):
        response = http.get(path)
        if allowed:
            assert response.status_code != 403, (path, response.text)
        else:
            assert response.status_code == 403, (path, response.text)
            error = response.json()["error"]
            assert error["code"] == "ip_not_allowed" and client[0] in error["message"]
    refused = http.post("/v1/completions", json={"prompt": "hi"})
    assert (refused.status_code == 403) is not allowed
    assert "x-request-id" in refused.headers  # as every answer of a generation route: its log line's id
    assert http.get("/health").status_code == 200 and http.head("/health").status_code == 200
    assert http.get("/ready").status_code == 503  # not loaded: the probe answers, it is not refused


def test_without_an_allow_list_every_address_may_call() -> None:
    assert TestClient(app(), client=("192.168.1.5", 5000)).get("/version").status_code == 200


def test_the_allow_list_is_validated_and_read_from_every_source(tmp_path: Any) -> None:
    assert load_config(None, environ={"DLM_ALLOWED_IPS": "10.0.0.0/8, 127.0.0.1"}).allowed_ips == [
        "10.0.0.0/8",
        "127.0.0.1",
    ]
    file = tmp_path / "serve.yaml"
    file.write_text("allowed_ips: [172.16.0.0/12]\n")
    assert load_config(file, environ={}).allowed_ips == ["172.16.0.0/12"]
    with pytest.raises(UsageError, match="invalid setting allowed_ips: '10.0.0.300' is not an IP"):
        load_config(None, {"allowed_ips": ["10.0.0.300"]}, environ={})


@pytest.mark.parametrize("client", [("10.0.0.7", 5000), ("::ffff:10.0.0.7", 5000)])
def test_an_entry_in_the_mapped_form_is_the_ipv4_network_it_names(client: tuple[str, int]) -> None:
    """A client seen as ::ffff:10.0.0.7 is matched as 10.0.0.7, so an entry written in that
    form (::ffff:10.0.0.0/104) matched no client at all: it is the IPv4 network 10.0.0.0/8."""
    http = TestClient(app(allowed_ips=["::ffff:10.0.0.0/104"]), client=client)
    assert http.get("/version").status_code == 200
    assert (
        TestClient(app(allowed_ips=["::ffff:10.0.0.0/104"]), client=("11.0.0.7", 1)).get("/version").status_code == 403
    )
    # ::/0 names IPv6 addresses: an IPv4 client, mapped or not, is none of them
    assert TestClient(app(allowed_ips=["::/0"]), client=client).get("/version").status_code == 403
