"""``dcr_format.system.environ.getenv``: ``os.environ.get`` at every call, without its cost where
the variable is not set (the kernels' dispatch reads ``DCR_KERNELS`` a dozen times a
tensor)."""

from __future__ import annotations

import os

import pytest

from dcr_format.delta.backend import kernels_mode
from dcr_format.kernels.native import native_kernels
from dcr_format.system.environ import getenv

NAME = "DCR_TEST_ENVIRON_READ"


def test_every_change_to_os_environ_is_seen_at_the_next_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(NAME, raising=False)
    assert getenv(NAME) is None
    monkeypatch.setenv(NAME, "first")
    assert getenv(NAME) == "first"
    os.environ[NAME] = "second é"  # not ASCII: decoded as os.environ decodes it
    assert getenv(NAME) == "second é" == os.environ[NAME]
    del os.environ[NAME]
    assert getenv(NAME) is None
    assert getenv("PATH") == os.environ.get("PATH")


def test_a_replaced_os_environ_is_read_instead(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "environ", {NAME: "replaced"})
    assert getenv(NAME) == "replaced"
    os.environ[NAME] = "again"
    assert getenv(NAME) == "again"
    monkeypatch.undo()
    assert getenv(NAME) == os.environ.get(NAME)


def test_the_kernel_choice_follows_dcr_kernels_call_by_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("DCR_KERNELS", raising=False)
    assert kernels_mode() == "auto"
    monkeypatch.setenv("DCR_KERNELS", " Torch ")
    assert kernels_mode() == "torch"
    assert native_kernels() is None
    monkeypatch.setenv("DCR_KERNELS", "")
    assert kernels_mode() == "auto"
    monkeypatch.setenv("DCR_KERNELS", "cuda")
    with pytest.raises(ValueError, match="DCR_KERNELS='cuda' is not one of auto, triton, torch"):
        kernels_mode()
