"""Device profiles and the storage rate limiter that emulates their storage."""

import threading
import time

import pytest

from edgerun.device.probe import measure_storage
from edgerun.device.profile import DeviceProfile, device_profiles, load_device_profile
from edgerun.errors import EdgerunError, ModelFormatError
from edgerun.offload.io import interpolate_rate
from edgerun.offload.throttle import StorageThrottle


def test_every_shipped_profile_loads_with_its_sources():
    names = device_profiles()
    assert {"rpi4", "rpi5", "rpi5-nvme", "laptop-8gb"} <= set(names)
    for n in names:
        p = load_device_profile(n)
        assert isinstance(p, DeviceProfile) and p.name == n
        assert 1 <= p.threads and 0 < p.ram_budget_bytes <= p.ram_bytes
        assert p.sources or p.assumptions  # every figure says where it comes from
        assert n in p.describe() and "MB/s" in p.describe()


def test_interpolation_between_read_sizes():
    pts = {4096: 10e6, 1 << 20: 40e6}
    assert interpolate_rate(pts, 1024) == 10e6 and interpolate_rate(pts, 8 << 20) == 40e6
    assert interpolate_rate(pts, 65536) == pytest.approx(10e6 + 0.5 * 30e6)


@pytest.mark.parametrize(
    "name, kind, size, nominal_mb_s",
    [
        ("rpi4", "sequential", 1 << 20, 40),
        ("rpi4", "random", 4096, 13.1),
        ("rpi5-nvme", "sequential", 1 << 20, 440),
        ("rpi5-nvme", "random", 4096, 71),
    ],
)
def test_throttled_reads_deliver_the_profiles_nominal_rate(
    tmp_path, name, kind, size, nominal_mb_s
):
    prof = load_device_profile(name)
    host = measure_storage(tmp_path, nbytes=16 << 20, chunks=(size,))[kind][size]
    if host < 2 * nominal_mb_s * 1e6:  # a throttle slows a disk down, never speeds it up
        pytest.skip(f"this disk ({host / 1e6:.0f} MB/s) is not faster than the emulated one")
    rates = []
    for _ in range(3):  # a slow spell of the shared host's disk only ever lowers a rate
        got = measure_storage(tmp_path, nbytes=16 << 20, chunks=(size,), throttle=prof.throttle())
        rates.append(got[kind][size] / 1e6)
        if abs(rates[-1] - nominal_mb_s) / nominal_mb_s < 0.10:
            break
    print(f"{name} {kind} {size} B: {rates} MB/s (nominal {nominal_mb_s}, host {host:.3g})")
    assert max(rates) < 1.10 * nominal_mb_s  # the throttle never lets reads run faster
    assert abs(max(rates) - nominal_mb_s) / nominal_mb_s < 0.10


def test_concurrent_reads_queue_on_one_emulated_device():
    t = StorageThrottle({4096: 4096 / 0.01}, {4096: 4096 / 0.01})  # 10 ms a read
    done = []

    def one(offset):
        deadline = t.admit(offset, 4096)
        t.wait_until(deadline)
        done.append(time.perf_counter())

    t0 = time.perf_counter()
    ths = [threading.Thread(target=one, args=(i * 1_000_000,)) for i in range(4)]
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    took = time.perf_counter() - t0
    assert 0.035 < took < 0.2, took  # one after another (0.01 s if they overlapped)
    assert t.device_seconds == pytest.approx(0.04)


def test_sequential_reads_are_recognised():
    t = StorageThrottle({4096: 100e6}, {4096: 1e6})
    t.admit(0, 4096)
    before = t.device_seconds
    t.admit(4096, 4096)  # continues the last read: the sequential rate
    assert t.device_seconds - before == pytest.approx(4096 / 100e6)
    t.admit(10 * 4096, 4096)  # a seek: the random rate
    assert t.device_seconds - before == pytest.approx(4096 / 100e6 + 4096 / 1e6)


@pytest.mark.parametrize(
    "text, field",
    [
        ("threads = 0", "threads"),
        ('ram = "lots"', "RAM budget"),
        ('ram_budget = "16G"', "ram_budget"),
        ('sequential_mb_s = { "4K" = -1 }', "storage.sequential_mb_s.4K"),
        ('random_mb_s = { "huge" = 5 }', "storage.random_mb_s.huge"),
        ('kernels = "neon"', "compute.kernels"),
    ],
)
def test_a_bad_profile_names_the_field(tmp_path, text, field):
    good = (load_device_profile("rpi4").path, text)
    src = open(good[0]).read().splitlines()
    key = text.split("=")[0].strip()
    out = [text if line.split("=")[0].strip() == key else line for line in src]
    f = tmp_path / "bad.toml"
    f.write_text("\n".join(out))
    with pytest.raises(ModelFormatError, match=field.replace(".", r"\.")):
        load_device_profile(f)


def test_unknown_profile_lists_the_known_ones():
    with pytest.raises(EdgerunError, match="rpi4"):
        load_device_profile("rpi9")


@pytest.mark.slow
def test_an_emulated_device_slows_offloaded_reads(smollm2_path, resident):
    import edgerun
    from edgerun.api import runtime_floor_bytes

    prof = load_device_profile("rpi4")
    need = resident.loader.minimum_ram_budget("dense") - resident.loader.floor_bytes
    budget = runtime_floor_bytes() + need + (24 << 20)
    m = edgerun.load(
        smollm2_path, n_ctx=256, ram_budget=budget, offload="dense", device_profile=prof
    )
    assert m.threads <= prof.threads and m.loader.device_profile is prof
    thr = m.store.flash_reader.throttle
    assert isinstance(thr, StorageThrottle)
    ids = m.tokenize("The three primary colours are")
    list(m.generate(ids, max_tokens=4, temperature=0.0))
    st = m.loader.offload_stats()
    assert st["bytes_read"] > 0 and thr.device_seconds > 0
    # reads take at least as long as the emulated microSD needs for them
    assert st["bytes_read"] / thr.device_seconds < 1.1 * 40e6


def test_modelled_speed_scales_the_compute_and_keeps_the_reads():
    from edgerun.tools.bench import modelled_tok_s

    # 100 ms a token, 40 of them waiting on (rate-limited) reads; compute at half speed
    assert modelled_tok_s(10.0, 0.04, 0.5) == pytest.approx(1 / (0.06 / 0.5 + 0.04))
    assert modelled_tok_s(10.0, 0.0, 0.29) == pytest.approx(2.9)
    assert modelled_tok_s(10.0, 1.0, 0.29) == pytest.approx(10.0)  # all reads: unscaled


def test_pi_profiles_carry_a_labelled_compute_factor():
    for name in ("rpi4", "rpi5", "rpi5-nvme"):
        p = load_device_profile(name)
        assert 0 < p.compute_scale < 2
        assert "published" in p.compute_note and "modelled" in p.describe()
    assert load_device_profile("laptop-8gb").compute_scale is None


def test_bench_with_a_scaled_profile_reports_modelled_figures(smollm2_path):
    import edgerun
    from edgerun.ops import qmatvec
    from edgerun.tools import bench

    before = qmatvec.kernel_path()
    try:
        m = edgerun.load(smollm2_path, n_ctx=64, device_profile="rpi5")
        # a Pi's kernels (generic int8), emulated by this host's int8 path where it has one
        host_int8 = qmatvec.available_paths()[-1]
        expect = host_int8 if host_int8 in qmatvec.INT8_PATHS else "portable"
        assert qmatvec.kernel_path() == expect
        rep = bench.run(m, 8, 8, repeats=1, bandwidth=False, progress=False, predict=False)
    finally:
        qmatvec.set_kernel_path(before)
    mod = rep["modelled"]
    assert mod["compute_scale"] == pytest.approx(1.05)
    measured = {r["test"]: r["median"] for r in rep["rows"]}
    for r in mod["rows"]:  # resident: nothing waits on reads, all of it scales
        assert r["tok_s"] == pytest.approx(1.05 * measured[r["test"]])
    assert "MODELLED on the device" in bench.format_table(rep)
