import pytest

from tests.integration.inproc import InProcessCluster


@pytest.fixture(scope="module")
def cluster():
    with InProcessCluster(workers=2) as c:
        yield c
