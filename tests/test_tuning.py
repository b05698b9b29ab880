"""Tuning data and the eager launch cache, without a GPU."""

from __future__ import annotations

import pytest

from torch_triton_gemm import tuning


class _RecordingKernel:
    """Stands in for a jitted kernel: records ``kernel[grid](*args, **meta)`` launches."""

    def __init__(self) -> None:
        self.launches: list[tuple] = []

    def __getitem__(self, grid):
        return lambda *args, **meta: self.launches.append((grid, args, meta))


class _RecordingAutotuner:
    """Stands in for triton.autotune's Autotuner: picks a config per call, records the call."""

    def __init__(self, picks: list[dict]) -> None:
        self.fn = _RecordingKernel()
        self.picks = picks
        self.runs: list[tuple] = []
        self.best_config = None

    def __getitem__(self, grid):
        def run(*args):
            pick = self.picks[len(self.runs)]
            self.runs.append((grid(pick), args))
            self.best_config = _Config(pick)

        return run


class _Config:
    def __init__(self, kwargs: dict) -> None:
        self.kwargs = kwargs

    def all_kwargs(self) -> dict:
        return dict(self.kwargs)


def _grid(meta):
    return (100 // meta["BLOCK_M"],)


def test_tuned_launch_tunes_once_per_key_then_launches_the_kept_config():
    picks = [{"BLOCK_M": 32, "num_warps": 4}, {"BLOCK_M": 64, "num_warps": 8}]
    autotuner = _RecordingAutotuner(picks)
    launch = tuning.TunedLaunch(autotuner)

    launch(("bucket", 1), _grid, ("a", 1))
    assert autotuner.runs == [((3,), ("a", 1))]
    assert autotuner.fn.launches == []

    launch(("bucket", 1), _grid, ("b", 2))
    launch(("bucket", 1), _grid, ("c", 3))
    assert len(autotuner.runs) == 1
    assert autotuner.fn.launches == [
        ((3,), ("b", 2), picks[0]),
        ((3,), ("c", 3), picks[0]),
    ]

    launch(("bucket", 2), _grid, ("d", 4))
    launch(("bucket", 2), _grid, ("e", 5))
    assert [run[0] for run in autotuner.runs] == [(3,), (1,)]
    assert autotuner.fn.launches[-1] == ((1,), ("e", 5), picks[1])


def test_tuned_launch_propagates_a_failed_tuning_and_keeps_nothing():
    autotuner = _RecordingAutotuner([])  # no pick: the autotuner raises IndexError
    launch = tuning.TunedLaunch(autotuner)
    with pytest.raises(IndexError):
        launch("key", _grid, ())
    with pytest.raises(IndexError):
        launch("key", _grid, ())
    assert autotuner.fn.launches == []
