from pathlib import Path

import pytest

from tests.helpers.certs import make_dev_certs
from tests.integration.inproc import InProcessCluster


@pytest.fixture(scope="module")
def cluster():
    with InProcessCluster(workers=2) as c:
        yield c


@pytest.fixture(scope="session")
def certs(tmp_path_factory) -> Path:
    """deploy/tls/make_dev_certs.sh's default certificates (no extra names), made once per run;
    tests read them and never change them."""
    return make_dev_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def tiny_gateway(tmp_path_factory):
    """A tiny-model cluster in this process and `python -m gateway_svc` in front of it:
    (cluster, gateway)."""
    from tests.helpers.gateway import GatewayProcess

    with InProcessCluster(workers=1) as c:
        gateway = GatewayProcess(c.address, tmp_path_factory.mktemp("gateway"))
        try:
            yield c, gateway
        finally:
            gateway.stop()
