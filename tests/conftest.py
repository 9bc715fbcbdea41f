import pytest

from edgerun import registry


@pytest.fixture(scope="session")
def smollm2_path():
    """The real default model. Fails (does not skip) when it is not installed."""
    m = registry.find("smollm2-135m")
    return registry.resolve_path(m)


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    import edgerun

    return edgerun.load(smollm2_path, n_ctx=1024, threads=2)
