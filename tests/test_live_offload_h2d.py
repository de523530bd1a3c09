"""live.h2d: the emulated link's timing, real copies, link kinds; the CUDA path (GPU only)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from live.h2d import LINK_KINDS, H2DLink
from live.offload import make_link

MB = 1_000_000


def _pairs(num_transfers: int, num_bytes: int):
    n = num_bytes // 4
    return [[(torch.empty(n), torch.full((n,), float(i)))] for i in range(num_transfers)]


def test_emulated_one_mb_at_one_gb_per_s_lasts_one_ms(fake_clock):
    """On a fake clock (tests/fake_clock.py) the emulated wait is exact: 1 MB at 1 GB/s = 1 ms."""
    link = make_link("cpu", bandwidth_gb_per_s=1.0)
    transfers = _pairs(1, MB)
    started = fake_clock.now_s
    fetch = link.fetch(transfers)
    assert fetch.num_bytes == MB and fetch.num_transfers == 1
    assert fetch.seconds() == pytest.approx(1e-3, abs=3 * fake_clock.tick_s)
    assert fake_clock.now_s - started >= 1e-3  # the link waited on the clock, not just reported
    assert torch.equal(transfers[0][0][0], transfers[0][0][1])  # and copied
    assert link.transfer_s(MB) == pytest.approx(1e-3)


def test_emulated_latency_is_paid_per_transfer(fake_clock):
    link = H2DLink("cpu", bandwidth_bytes_per_s=1e12, latency_s=2e-3)
    fetch = link.fetch(_pairs(5, 4096))
    assert fetch.seconds() == pytest.approx(5 * (2e-3 + 4096 / 1e12), abs=15 * fake_clock.tick_s)
    assert link.kind == "cpu-emulated" and link.info.latency_s == 2e-3


def test_emulated_copy_is_not_shortened_by_a_late_one(monkeypatch):
    """Each copy waits for its own share measured from its own start: a sleep that wakes 4 ms
    late makes every 8 ms copy last 11 ms (sleep to 1 ms before the end, +4 ms) and never makes
    the next copy shorter to catch up."""
    from fake_clock import FakeClock

    clock = FakeClock(sleep_overshoot_s=4e-3).install(monkeypatch)
    fetch = make_link("cpu", bandwidth_gb_per_s=1.0).fetch(_pairs(4, 8 * MB))
    np.testing.assert_allclose(fetch.copy_seconds(), 11e-3, atol=3 * clock.tick_s)
    assert len(clock.sleeps) == 4 and clock.sleeps[0] == pytest.approx(7e-3, abs=3 * clock.tick_s)


def test_memcpy_link_copies_data_and_is_described():
    link = H2DLink("cpu")
    transfers = _pairs(3, 4096)
    fetch = link.fetch(transfers)
    for i, transfer in enumerate(transfers):
        dst, src = transfer[0]
        assert torch.equal(dst, src) and dst.data_ptr() != src.data_ptr() and dst[0] == i
    assert fetch.num_bytes == 3 * 4096 and fetch.seconds() >= 0
    assert link.kind == "cpu-memcpy" and link.kind in LINK_KINDS
    assert link.info.to_dict() == {
        "device": "cpu",
        "kind": "cpu-memcpy",
        "bandwidth_bytes_per_s": None,
        "latency_s": 0.0,
        "pinned": False,
    }
    empty = link.fetch([])
    assert empty.num_bytes == 0 and empty.seconds() == 0.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"bandwidth_bytes_per_s": 0.0}, "bandwidth_bytes_per_s"),
        ({"bandwidth_bytes_per_s": -5.0}, "bandwidth_bytes_per_s"),
        ({"bandwidth_bytes_per_s": float("inf")}, "bandwidth_bytes_per_s"),
        ({"latency_s": -1.0}, "latency_s"),
    ],
)
def test_bad_link_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        H2DLink("cpu", **kwargs)


def test_make_link_names_cli_flags():
    with pytest.raises(ValueError, match="--bandwidth"):
        make_link("cpu", -1.0)
    with pytest.raises(ValueError, match="--latency"):
        make_link("cpu", 1.0, latency_s=-1e-3)
    with pytest.raises(ValueError, match="--device"):
        make_link("meta")
    assert make_link("cpu", 2.0, 1e-5).info.bandwidth_bytes_per_s == 2e9


def test_bad_device_is_named():
    with pytest.raises(ValueError, match="device"):
        H2DLink("meta")
    with pytest.raises(ValueError, match="only available with device 'cpu'|CUDA is not available"):
        H2DLink("cuda", bandwidth_bytes_per_s=1e9)


# ---------------------------------------------------------------------------------------------
# CUDA path
# ---------------------------------------------------------------------------------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
def test_cuda_link_pins_and_times_with_events():
    link = H2DLink("cuda")
    host = link.prepare_host(torch.randn(64, 1024, 1024))  # 256 MiB
    assert host.is_pinned() and link.kind == "cuda-pinned"
    dst = torch.empty_like(host, device=link.device)
    fetch = link.fetch([[(dst[i], host[i])] for i in range(64)])
    seconds = fetch.seconds()
    assert torch.equal(dst.cpu(), host)
    assert seconds > 0  # its bandwidth: calibration.h2d in benchmarks/gpu_check.sh (no timing aims here)


@pytest.mark.gpu
@needs_cuda
def test_cuda_pageable_fallback_is_said_once(monkeypatch):
    link = H2DLink("cuda")

    def refuse(self, *args, **kwargs):
        raise RuntimeError("pinning refused")

    monkeypatch.setattr(torch.Tensor, "pin_memory", refuse)
    with pytest.warns(RuntimeWarning, match="pageable"):
        a = link.prepare_host(torch.randn(8))
    b = link.prepare_host(torch.randn(8))  # no second warning: kind already pageable
    assert not a.is_pinned() and not b.is_pinned()
    assert link.kind == "cuda-pageable"


@pytest.mark.gpu
@needs_cuda
def test_cuda_offloaded_equals_resident(tiny_checkpoint):
    from live_fixtures import make_cache

    from live.loader import describe_moe, load_target
    from live.offload import OffloadedMoE

    path = tiny_checkpoint("qwen3_moe")
    resident = load_target(path, "cuda", experts_on_device=True)
    model = load_target(path, "cuda")
    spec = describe_moe(model)
    engine = OffloadedMoE.install(
        model, make_cache("lru", spec.num_layers, spec.num_experts, 3), H2DLink("cuda")
    )
    prompt = torch.tensor([[5, 17, 42, 8, 90, 33, 61, 7]], device="cuda")
    with torch.no_grad():
        want = resident(prompt).logits
        engine.begin_forward()
        got = model(prompt).logits
        stats = engine.end_forward()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert stats.misses > 0 and stats.h2d_s > 0 and stats.compute_s > 0
    assert engine.h2d_link.kind == "cuda-pinned"


def test_per_copy_timings_recover_a_4_gb_per_s_20_us_link(fake_clock):
    """Experts of the embedded default's shape (gate/up 65,536 B + down 32,768 B): per-copy
    timings sum to the fetch's seconds, and a fit on them recovers bandwidth and per-expert
    latency of the emulated link (the link charges each copy bytes/bw + latency/2). On the fake
    clock every copy lasts its charge within a few clock reads (``tick_s``); the same figures on
    the real clock are ``benchmarks/h2d_link.py``."""
    from calibration.link import fit_link

    link = make_link("cpu", bandwidth_gb_per_s=4.0, latency_s=20e-6)
    host = [(torch.ones(128, 128), torch.ones(128, 64)) for _ in range(4)]
    dst = (torch.empty(128, 128), torch.empty(128, 64))
    transfers = [list(zip(dst, host[i % 4])) for i in range(150)]
    fetch = link.fetch(transfers)
    copy_s = fetch.copy_seconds()
    assert fetch.copies_per_transfer.tolist() == [2] * 150
    assert fetch.copy_bytes[:2].tolist() == [65536, 32768] and fetch.num_bytes == 150 * 98304
    assert copy_s.sum() == pytest.approx(fetch.seconds(), rel=1e-9)
    tick = fake_clock.tick_s
    np.testing.assert_allclose(copy_s[0::2], 65536 / 4e9 + 10e-6, atol=3 * tick)
    np.testing.assert_allclose(copy_s[1::2], 32768 / 4e9 + 10e-6, atol=3 * tick)
    fit = fit_link(fetch.copy_bytes, np.ones(copy_s.size), copy_s, robust=True)
    assert fit.identifiable
    assert fit.bytes_per_s == pytest.approx(4e9, rel=1e-3)
    assert 2 * fit.s_per_transfer == pytest.approx(20e-6, abs=6 * tick)


def test_event_timed_fetch_splits_seconds_per_copy():
    """The CUDA path's per-copy split, with stand-in events (elapsed_time in ms from the first)."""

    from live.h2d import H2DFetch

    class _Event:
        def __init__(self, t_ms: float) -> None:
            self.t_ms = t_ms

        def synchronize(self) -> None:
            pass

        def elapsed_time(self, end: _Event) -> float:
            return end.t_ms - self.t_ms

    events = [_Event(t) for t in (5.0, 5.5, 5.75, 6.5)]
    fetch = H2DFetch(
        300, 1, events=events, copy_bytes=np.array([100, 100, 100]), copies_per_transfer=np.array([3])
    )
    np.testing.assert_allclose(fetch.copy_seconds(), [0.5e-3, 0.25e-3, 0.75e-3])
    assert fetch.seconds() == pytest.approx(1.5e-3)
