"""bench_local's lm-resiliency rows: what they say when it did not run, and their units."""

from __future__ import annotations

import argparse

from benchmarks._local_lmres import lmres_table, lmres_title, run_lmres


def _args(tmp_path, python: str, lmres_mib: int = 0) -> argparse.Namespace:
    return argparse.Namespace(
        lmres_python=python,
        lmres_mib=lmres_mib,
        parity_mib=1024,
        parity_world=4,
        parity_k=4,
        repeats=3,
        dir=str(tmp_path),
    )


def test_lmres_rows_say_na_with_the_reason_when_its_python_does_not_run(tmp_path):
    args = _args(tmp_path, str(tmp_path / "no-such-python"))
    res = run_lmres(args)
    rows = lmres_table(res, 4, 1024)
    assert rows[0]["lm-resiliency"].startswith("n/a (") and "no-such-python" in str(rows[0])
    assert lmres_title(res, args) == "lm-resiliency: not measured"


def test_lmres_rows_give_seconds_per_gib_when_its_size_differs_from_ours():
    keys = {
        "lmres save blocks s": 0.5,
        "lmres replicated s": 1.0,
        "lmres memory rollback s": 0.25,
        "lmres flush s": 2.0,
        "lmres copy to replacement s": 1.0,
        "lmres restart load s": 1.0,
        "lmres recovery s": 4.0,
        "lmres host RAM kept / state": 4.0,
        "lmres disk after flush / state": 4.0,
        "lmres MiB per rank": 256,
        "parity k4 recovery s": 2.0,
        "clique f2 recovery s": 1.0,
        "parity k4 bytes kept / state": 1.33,
        "parity k4 save s": 3.0,
    }
    rows = {r["what"]: r for r in lmres_table(dict(keys), 4, 1024)}
    recovery = rows["recovery of a lost node's part s/GiB"]
    assert recovery["lm-resiliency"] == 16.0 and recovery["parity k4"] == 2.0
    assert recovery["clique f2"] == 1.0 and recovery["parity / lm-res"] == "0.12"
    kept = rows["copies kept per rank / state"]
    assert kept["lm-resiliency"] == 4.0 and kept["parity k4"] == 1.33
    assert rows["sync save s/GiB"]["lm-resiliency"].startswith("n/a (")
    same = {r["what"]: r for r in lmres_table(dict(keys, **{"lmres MiB per rank": 1024}), 4, 1024)}
    assert same["recovery of a lost node's part s"]["lm-resiliency"] == 4.0
