"""The tiny MiniCPM-o 4.5 the plugin's tests run: built once per test session by our builder
in the official checkpoint layout (plugins/minicpmo/builder.py), loaded once."""

import pytest

from plugins.minicpmo.builder import build_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("minicpmo") / "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_weights(tiny_checkpoint):
    from plugins.minicpmo.model import MiniCPMOWeights

    return MiniCPMOWeights.load(tiny_checkpoint)
