"""`asr-bench`: every benchmark reachable by name through one front door, none registered by hand."""

from __future__ import annotations

import ast

import pytest

from harness import bench


def test_every_benchmark_script_is_listed_with_what_it_measures(capsys: pytest.CaptureFixture[str]) -> None:
    scripts = sorted(bench.SCRIPTS.glob("bench_*.py"))
    assert len(scripts) >= 10
    for path in scripts:
        tree = ast.parse(path.read_text())
        assert ast.get_docstring(tree), f"{path.name} says nothing of what it measures"
        assert any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body), path.name
    assert bench.main([]) == 0
    listed = capsys.readouterr().out
    for path in scripts:
        assert f"  {path.stem.removeprefix('bench_')} " in listed, path.name
    assert "  ab " in listed


def test_a_benchmark_runs_by_name_with_its_own_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        bench.main(["ab", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: asr-bench ab") and "--a-ref" in out and "--b-ref" in out


def test_an_unknown_benchmark_is_refused_with_the_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["no-such-bench"]) == 2
    err = capsys.readouterr().err
    assert "no benchmark 'no-such-bench'" in err and "keyterms" in err
