"""The package's environment variables: spellings each accepts, and one warning naming the
variable (and the default used) for a value that makes no sense, never an error in a call."""

from __future__ import annotations

import warnings

import pytest

import torch_triton_gemm as tg
from torch_triton_gemm import env, tuning
from torch_triton_gemm.ops import compile_pool, grouped_launch

NAME = "TORCH_TRITON_GEMM_TEST_VARIABLE"


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(env, "_WARNED", set())


@pytest.mark.parametrize("value, expected", [
    (None, "default"), ("", "default"), ("  ", "default"), ("1", True), ("TRUE", True),
    (" yes ", True), ("On", True), ("0", False), ("false", False), ("NO", False), ("off", False)])
@pytest.mark.parametrize("default", [True, False])
def test_flags(monkeypatch, value, expected, default):
    if value is None:
        monkeypatch.delenv(NAME, raising=False)
    else:
        monkeypatch.setenv(NAME, value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert env.flag(NAME, default) is (default if expected == "default" else expected)


def test_a_bad_value_warns_once_naming_the_variable(monkeypatch):
    monkeypatch.setenv(NAME, "maybe")
    with pytest.warns(RuntimeWarning, match=f"{NAME}='maybe' is not one of") as caught:
        assert env.flag(NAME, True) is True
        assert env.flag(NAME, True) is True
    assert len(caught) == 1
    monkeypatch.setenv(NAME, "abc")
    with pytest.warns(RuntimeWarning, match="a whole number of at least 1"):
        assert env.integer(NAME, 4, least=1) == 4
    for bad in ("1.5", "-3", "0"):
        monkeypatch.setenv(NAME, bad)
        with pytest.warns(RuntimeWarning, match=NAME):
            assert env.integer(NAME, 4, least=1) == 4
    monkeypatch.setenv(NAME, " 12 ")
    assert env.integer(NAME, 4, least=1) == 12
    monkeypatch.setenv(NAME, "Always")
    assert env.choice(NAME, {"auto": "auto", "always": "always"}, "auto") == "always"
    monkeypatch.setenv(NAME, "sometimes")
    with pytest.warns(RuntimeWarning, match="one of auto, always; using the default"):
        assert env.choice(NAME, {"auto": "auto", "always": "always"}, "auto") == "auto"


def test_the_package_reads_its_variables_this_way(monkeypatch):
    """Each variable's reader: common spellings work, bad values warn and keep the default."""
    tuning.autotune_enabled.cache_clear()
    grouped_launch.offs_check_mode.cache_clear()
    try:
        monkeypatch.setenv("TORCH_TRITON_GEMM_PITCH_HINTS", "off")
        assert not tuning.pitch_hints_enabled()
        monkeypatch.setenv("TORCH_TRITON_GEMM_BACKGROUND_COMPILE", "false")
        assert compile_pool.background_switched_off()
        monkeypatch.setenv("TORCH_TRITON_GEMM_CHECK_OFFS", "NEVER")
        assert grouped_launch.offs_check_mode() == "never"
        monkeypatch.setenv("TORCH_TRITON_GEMM_COMPILE_PROCESSES", "two")
        with pytest.warns(RuntimeWarning, match="TORCH_TRITON_GEMM_COMPILE_PROCESSES='two'"):
            assert compile_pool.compile_processes() == 0
        monkeypatch.setenv("TORCH_TRITON_GEMM_COMPILE_THREADS", "abc")
        with pytest.warns(RuntimeWarning, match="TORCH_TRITON_GEMM_COMPILE_THREADS='abc'"):
            assert 1 <= compile_pool.CompilePool(lambda: None).workers() <= 8
        monkeypatch.setenv("TORCH_TRITON_GEMM_WHILE_COMPILING", "later")
        with pytest.warns(RuntimeWarning, match="TORCH_TRITON_GEMM_WHILE_COMPILING='later'"):
            assert tg.override().while_compiling == "wait"
        monkeypatch.setenv("TORCH_TRITON_GEMM_WHILE_COMPILING", "")
        assert tg.override().while_compiling == "wait"
    finally:
        tuning.autotune_enabled.cache_clear()
        grouped_launch.offs_check_mode.cache_clear()
