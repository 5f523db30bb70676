"""The suite's own settings (tests/conftest.py): the tests CI runs on one of its two legs only name tests that exist
and a leg that exists, .ci/run tells each leg its name, and outside CI every test runs."""
import ast
import re

import pytest

from tests import conftest
from tests.helpers import ROOT


def _tests(stem):
  """The test functions of a test file."""
  tree = ast.parse((ROOT / "tests" / f"{stem}.py").read_text())
  return {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}


def test_one_leg_and_dealt_name_existing_tests_and_legs():
  assert conftest.ONE_LEG and conftest.DEALT
  assert all(leg in conftest.CI_LEGS for leg in conftest.ONE_LEG.values()), conftest.ONE_LEG
  for key in [*conftest.ONE_LEG, *conftest.DEALT]:
    stem, _, name = key.partition("::")
    assert (ROOT / "tests" / f"{stem}.py").is_file(), key
    assert not name or name in _tests(stem), key
  assert not set(conftest.ONE_LEG) & set(conftest.DEALT)


def test_the_leg_of_a_test_is_its_own_or_its_files(monkeypatch):
  monkeypatch.setattr(conftest, "ONE_LEG", {"test_a": "py312", "test_b::test_c": "py311"})
  assert conftest.one_leg("tests/test_a.py::test_x[1-2]") == "py312"
  assert conftest.one_leg("tests/test_b.py::test_c[p]") == "py311"
  assert conftest.one_leg("tests/test_b.py::test_cd") is None
  assert conftest.one_leg("tests/test_c.py::test_c") is None


def test_ci_tells_each_leg_its_name():
  ci = (ROOT / ".ci" / "run").read_text()
  assert re.search(r"^\s*export SINKJAX_CI_LEG=\$name$", ci, re.M), "see tests/conftest.py, ONE_LEG"
  assert set(re.findall(r"^\s*(py3\d+)\) leg py3", ci, re.M)) == set(conftest.CI_LEGS)


class _Item:
  def __init__(self, nodeid):
    self.nodeid, self.path = nodeid, ROOT / nodeid.split("::")[0]


class _Config:
  def __init__(self):
    self.deselected = []
    self.hook = self

  def pytest_deselected(self, items):
    self.deselected += items


ITEMS = ["tests/test_n.py::test_x", "tests/test_b.py::test_x", "tests/test_a.py::test_x",
         "tests/test_d.py::test_p[1]", "tests/test_d.py::test_p[2]", "tests/test_d.py::test_p[3]",
         "tests/test_d.py::test_q[1]", "tests/test_d.py::test_q[2]", "tests/test_d.py::test_one"]


@pytest.mark.parametrize("leg,kept", [
    (None, ITEMS),
    ("py312", [ITEMS[0], ITEMS[2], ITEMS[3], ITEMS[5], ITEMS[6], ITEMS[8]]),
    ("py311", [ITEMS[0], ITEMS[1], ITEMS[4], ITEMS[7], ITEMS[8]])])
def test_ci_runs_a_test_on_its_leg_deals_cases_and_everyone_else_runs_all(leg, kept, monkeypatch):
  """One-leg tests run on their leg, a dealt test's cases alternate between the legs (each leg runs the test, every
  case runs once), the rest run on both; without SINKJAX_CI_LEG every test runs."""
  monkeypatch.setattr(conftest, "ONE_LEG", {"test_a": "py312", "test_b": "py311"})
  monkeypatch.setattr(conftest, "DEALT", ("test_d::test_p", "test_d::test_q", "test_d::test_one"))
  if leg:
    monkeypatch.setenv("SINKJAX_CI_LEG", leg)
  else:
    monkeypatch.delenv("SINKJAX_CI_LEG", raising=False)
  items = [_Item(i) for i in ITEMS]
  config = _Config()
  conftest.pytest_collection_modifyitems(config, items)
  assert sorted(i.nodeid for i in items) == sorted(kept)
  assert sorted(i.nodeid for i in config.deselected) == sorted(set(ITEMS) - set(kept))


def test_an_unknown_leg_is_refused(monkeypatch):
  """A mistyped SINKJAX_CI_LEG would silently run every test: pytest refuses it."""
  monkeypatch.setenv("SINKJAX_CI_LEG", "py313")
  with pytest.raises(pytest.UsageError, match="SINKJAX_CI_LEG=py313"):
    conftest.pytest_collection_modifyitems(_Config(), [])


def test_dealt_cases_go_two_to_py312_for_one_to_py311(monkeypatch):
  """Seven cases of one dealt test: py312, py311, py312, py312, py311, py312, py312 (a two-case test runs on both)."""
  monkeypatch.setattr(conftest, "ONE_LEG", {})
  monkeypatch.setattr(conftest, "DEALT", ("test_d::test_p",))
  items = [_Item(f"tests/test_d.py::test_p[{i}]") for i in range(7)]
  legs = conftest.ci_legs(items)
  assert [legs[id(i)] for i in items] == ["py312", "py311", "py312", "py312", "py311", "py312", "py312"]
