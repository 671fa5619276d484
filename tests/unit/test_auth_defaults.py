"""Safe defaults, as data: who a TLS worker admits when nobody said, and when the gateway may
serve callers that show no key."""

from __future__ import annotations

import pytest

from gateway_svc.config import AuthMode, GatewayConfig
from kvfleet_common.security import SCHEDULER_CLIENT, TlsConfig

DEFAULT = frozenset({SCHEDULER_CLIENT})
SERVER = {"KVFLEET_TLS_CERT": "w.pem", "KVFLEET_TLS_KEY": "w.key", "KVFLEET_TLS_CA": "ca.pem"}


@pytest.mark.parametrize(
    "env,admitted",
    [
        ({}, None),  # plaintext: no names to check
        ({**SERVER, "KVFLEET_TLS_CLIENT_AUTH": "true"}, DEFAULT),  # mutual TLS, nothing said
        ({**SERVER, "KVFLEET_TLS_CLIENT_AUTH": "true", "KVFLEET_TLS_ALLOWED_CLIENTS": " "}, DEFAULT),
        (SERVER, DEFAULT),  # TLS without client certificates
        ({**SERVER, "KVFLEET_TLS_CLIENT_AUTH": "true", "KVFLEET_TLS_ALLOWED_CLIENTS": "a, b"}, frozenset({"a", "b"})),
        ({**SERVER, "KVFLEET_TLS_CLIENT_AUTH": "true", "KVFLEET_TLS_ALLOWED_CLIENTS": "*"}, None),  # said so
        ({"KVFLEET_TLS_ALLOWED_CLIENTS": "a"}, frozenset({"a"})),  # names without TLS admit nobody
    ],
)
def test_admitted_clients(env: dict[str, str], admitted: frozenset[str] | None) -> None:
    assert TlsConfig.from_env(env).admitted_clients(DEFAULT) == admitted


@pytest.mark.parametrize(
    "kwargs,mode",
    [
        ({}, AuthMode.OPEN),
        ({"allow_anonymous": True}, AuthMode.OPEN),  # no token to hand out
        ({"api_key": "k"}, AuthMode.OWN_KEY),
        ({"api_key": "k", "scheduler_token": "t"}, AuthMode.OWN_KEY),
        ({"pass_through_key": True}, AuthMode.PASS_THROUGH),
        ({"pass_through_key": True, "scheduler_token": "t"}, AuthMode.PASS_THROUGH),
        ({"scheduler_token": "t", "allow_anonymous": True}, AuthMode.ANONYMOUS),
    ],
)
def test_gateway_auth_mode(kwargs: dict, mode: AuthMode) -> None:
    assert GatewayConfig(**kwargs).auth_mode is mode


def test_a_gateway_holding_the_schedulers_token_needs_a_key_or_to_be_told() -> None:
    with pytest.raises(ValueError, match="--allow-anonymous") as info:
        GatewayConfig(scheduler_token="t")
    assert "KVFLEET_GATEWAY_API_KEY" in str(info.value) and "--pass-through-key" in str(info.value)
    with pytest.raises(ValueError, match="not both"):
        GatewayConfig(api_key="k", pass_through_key=True)
