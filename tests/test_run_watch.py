"""benchmarks/run_watch.py's pure parts (NVML itself needs the GPU machine)."""
from benchmarks.run_watch import summary


def test_summary_counts_power_capped_samples():
    samples = [(0.0, 1980, 600.0, 40, 0x0), (0.01, 1755, 700.0, 45, 0x4), (0.02, 1800, 690.0, 50, 0x4 | 0x1)]
    text = summary(samples)
    assert "SM MHz min 1755 median 1800" in text
    assert "power W median 690 max 700" in text
    assert "40->50 C" in text
    assert "power-capped in 2 of 3 samples" in text
