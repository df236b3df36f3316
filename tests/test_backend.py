"""One backend per tensor: chosen once from ``DCR_KERNELS``, passed down, the same bits on
every backend; a ``ulp`` change's steps stay on the bits' device."""

from __future__ import annotations

import pytest
import torch

from dcr_format.codings import ulp
from dcr_format.delta.backend import Backend
from dcr_format.delta.backend_numba import NumbaBackend
from dcr_format.delta.backends import REFERENCE, backend_for, backend_on
from dcr_format.delta.delta import XOR, DecodedDelta, after_bits, apply_change, encode_tensor
from dcr_format.format.dtypes import bits_view


def _change(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    old = (torch.randn(5000, generator=gen) * 0.02).bfloat16()
    new = old.clone()
    new[::13] = (new[::13].float() * 1.01).bfloat16()
    return old, new


def test_the_choice_reads_the_setting_once(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.zeros(4, dtype=torch.int16)
    monkeypatch.delenv("DCR_KERNELS", raising=False)
    chosen = backend_for(cpu)
    assert isinstance(chosen, NumbaBackend) and backend_on("cpu") is chosen
    old, new = _change(1)
    want = REFERENCE.diff_with_lanes(bits_view(old), bits_view(new))
    monkeypatch.setenv("DCR_KERNELS", "torch")  # read at the next choice, not by a chosen one
    assert backend_for(cpu) is REFERENCE
    got = chosen.diff_with_lanes(bits_view(old), bits_view(new))
    assert got[1] == want[1] and torch.equal(got[0].positions, want[0].positions)
    assert torch.equal(got[0].xor_values, want[0].xor_values)


def test_a_passed_backend_is_the_one_that_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    class Counting(Backend):
        def apply_with_lanes(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            calls.append("apply")
            return super().apply_with_lanes(*args, **kwargs)

    old, new = _change(2)
    encoded = encode_tensor(new, old, op=XOR)
    assert encoded.advance is not None
    target = old.clone()
    apply_change(target, encoded.advance, backend=Counting())
    assert calls == ["apply"] and torch.equal(bits_view(target), bits_view(new))


def test_ulp_steps_stay_on_the_device_of_the_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference backend steps bits that are not in host memory where they are (a
    ``meta`` tensor cannot be copied to the host at all); host bits take the host loop, the
    same bits."""
    monkeypatch.setenv("DCR_KERNELS", "torch")
    old, new = _change(3)
    before, after = bits_view(old).reshape(-1)[::13], bits_view(new).reshape(-1)[::13]
    z = torch.from_numpy(ulp.to_ulp(before.numpy().view("<u2"), after.numpy().view("<u2")))
    delta = DecodedDelta(XOR, torch.arange(0, 5000, 13), z.view(torch.int16), ulp=True)
    assert torch.equal(after_bits(delta, before), after)
    on_meta = after_bits(delta, before.to("meta"))
    assert on_meta.device.type == "meta" and on_meta.dtype == torch.int16
