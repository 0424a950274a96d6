"""Version bookkeeping: the engine serves the version ``lag`` optimizer steps behind, with
those weights in the live parameters, and restores the latest after."""

import pytest
import torch

from hieragent.engines.base import Engine, EngineSettings


def params(value):
    return {"a": torch.nn.Parameter(torch.full((2,), float(value))),
            "b": torch.nn.Parameter(torch.full((3,), -float(value)))}


def set_to(live, value):
    with torch.no_grad():
        live["a"].fill_(float(value))
        live["b"].fill_(-float(value))


@pytest.mark.parametrize("lag", [0, 1, 3])
def test_lagged_serves_the_version_lag_steps_behind_and_restores_the_latest(lag):
    engine, live = Engine(EngineSettings(), lag=lag), params(0)
    for version in range(6):
        set_to(live, 10 + version)  # the optimizer step's new weights
        engine.sync(live, version)
        want = max(version - lag, 0)  # early in a run: the oldest there is
        assert engine.version == version and engine.latest_version == version
        with engine.lagged() as served:
            assert served == engine.version == want
            assert live["a"].tolist() == [10.0 + want] * 2 and live["b"].tolist() == [-10.0 - want] * 3
        assert engine.version == version
        assert live["a"].tolist() == [10.0 + version] * 2  # the trainer's weights are back
    assert engine.versions == list(range(5 - lag, 6))


def test_resyncing_a_version_replaces_it_and_going_back_is_refused():
    engine, live = Engine(EngineSettings(), lag=1), params(1)
    engine.sync(live, 0)
    engine.sync(live, 1)
    set_to(live, 5)
    engine.sync(live, 1)  # reloaded weights under the same step
    assert engine.versions == [0, 1]
    with pytest.raises(ValueError, match="older than the latest"):
        engine.sync(live, 0)
    with engine.lagged():
        with pytest.raises(RuntimeError, match="inside engine.lagged"):
            engine.sync(live, 2)
    assert live["a"].tolist() == [5.0, 5.0]


def test_bad_engine_settings_name_their_key():
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineSettings(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="cache_prompts"):
        EngineSettings(cache_prompts=-1)
