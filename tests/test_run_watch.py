"""benchmarks/run_watch.py's pure parts (NVML itself needs the GPU machine)."""
import os

from benchmarks.run_watch import compiled_between, summary


def test_compiled_between_names_only_the_kernels_written_in_the_window(tmp_path):
    for name, mtime in (("early", 100.0), ("during", 150.0), ("late", 300.0)):
        entry = tmp_path / name
        entry.mkdir()
        (entry / f"_{name}_kernel.json").write_text("{}")
        (entry / f"__grp___{name}_kernel.json").write_text("{}")
        (entry / f"_{name}_kernel.cubin").write_bytes(b"")
        os.utime(entry, (mtime, mtime))
    assert compiled_between(str(tmp_path), 120.0, 200.0) == ["_during_kernel"]
    assert sorted(compiled_between(str(tmp_path), 0.0, 1000.0)) == ["_during_kernel", "_early_kernel", "_late_kernel"]
    assert compiled_between(str(tmp_path), 400.0, 500.0) == []


def test_summary_counts_power_capped_samples():
    samples = [(0.0, 1980, 600.0, 40, 0x0), (0.01, 1755, 700.0, 45, 0x4), (0.02, 1800, 690.0, 50, 0x4 | 0x1)]
    text = summary(samples)
    assert "SM MHz min 1755 median 1800" in text
    assert "power W median 690 max 700" in text
    assert "40->50 C" in text
    assert "power-capped in 2 of 3 samples" in text
