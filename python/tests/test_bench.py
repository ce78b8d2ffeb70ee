"""python -m gdncp.bench runs (a small shape) and its two sides agree: the agreement it prints is
the comparison of test_torch.py (whose negative control covers it)."""
from gdncp import bench


def test_bench_runs_and_agrees(capsys):
    assert bench.main(["--T", "80", "--Hk", "1", "--Hv", "2", "--K", "16", "--V", "16",
                       "--reps", "1"]) == 0
    out = capsys.readouterr().out
    assert "speed-up (transformers / gdncp)" in out and "forward+backward" in out, out
    rows, err = bench.run(T=80, Hk=1, Hv=2, K=16, V=16, reps=1)
    assert err < 2e-5 and [r[0] for r in rows] == ["transformers", "gdncp"]
