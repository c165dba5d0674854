"""The engine's threads follow the CPUs the process may really use (engine/process/cpus.py): its affinity mask,
capped by a cgroup CPU quota, which torch's own default ignores."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine import EngineConfig
from engine.model.runner import ModelRunner, engine_threads
from engine.process.cpus import usable_cpus


def test_a_cgroup_quota_caps_the_usable_cpus(tmp_path: Path) -> None:
    affinity = len(os.sched_getaffinity(0))
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("max 100000\n")
    assert usable_cpus(v2) == affinity  # no quota
    (v2 / "cpu.max").write_text("100000 100000\n")
    assert usable_cpus(v2) == 1
    (v2 / "cpu.max").write_text("150000 100000\n")
    assert usable_cpus(v2) == min(affinity, 2)  # a part of a CPU counts as a whole one
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu/cpu.cfs_quota_us").write_text("50000\n")
    (v1 / "cpu/cpu.cfs_period_us").write_text("100000\n")
    assert usable_cpus(v1) == 1
    (v1 / "cpu/cpu.cfs_quota_us").write_text("-1\n")  # v1's "no quota"
    assert usable_cpus(v1) == affinity
    assert usable_cpus(tmp_path / "none") == affinity


@pytest.fixture
def one_cpu() -> Iterator[None]:
    """This process on one CPU for the test (the engine must follow the mask, not torch's start-up count)."""
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    if len(affinity) < 2:
        pytest.skip("needs a machine with two CPUs or more to narrow the mask")
    os.sched_setaffinity(0, {min(affinity)})
    try:
        yield
    finally:
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)


def test_the_engine_runs_as_many_threads_as_usable_cpus(random_model: Path, one_cpu: None) -> None:
    assert engine_threads(EngineConfig(threads=3)) == 3  # an operator's own count wins
    ModelRunner.load(EngineConfig(model=str(random_model), threads=0, warmup=False))
    assert torch.get_num_threads() == usable_cpus() == 1
