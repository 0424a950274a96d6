import pytest

from cli_helpers import make_workspace


@pytest.fixture()
def workspace(tmp_path):
    """A scratch directory with the repo's configs and data linked in."""
    return make_workspace(tmp_path)
