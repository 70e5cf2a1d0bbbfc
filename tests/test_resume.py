"""Resume after SIGKILL under torchrun --max-restarts 1 is bit-exact at every kill point.

Reference: the same job undisturbed. Each kill point runs once here, with the
victims alternating; ``python -m tests.resume_matrix`` (``nox -s stress``) runs
every point with each rank as the victim ten times in a row.
"""

from __future__ import annotations

import pytest

from tests import resume_matrix


@pytest.fixture(scope="module")
def calm(tmp_path_factory):
    directory = tmp_path_factory.mktemp("calm")
    done = resume_matrix.torchrun(directory)
    assert done.returncode == 0, done.stderr[-3000:]
    return resume_matrix.final_params(directory)


@pytest.mark.parametrize(
    ("point", "victim"),
    [("after_update", 1), ("mid_forward", 0), ("mid_backward", 1), ("mid_save", 0)],
)
def test_a_killed_rank_resumes_bit_exactly(calm, tmp_path, point, victim):
    problem = resume_matrix.check(tmp_path, calm, point, victim)
    assert problem is None, problem
