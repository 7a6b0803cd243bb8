"""The house's import rules (experiments <- engine <- env <- agents <- rlctl, no cycles), read from the source."""
from __future__ import annotations

from tests.import_graph import cycles, graph, layer, modules, upward


def test_no_module_imports_a_higher_layer():
    assert upward(graph()) == []


def test_there_are_no_import_cycles():
    assert cycles(graph()) == []


def test_the_engine_imports_nothing_of_ours_but_itself_and_the_shipped_data():
    assert {b.split(".")[0] for a, bs in graph().items() if a.startswith("engine") for b in bs} <= {"engine", "experiments"}


def test_the_shipped_data_imports_nothing_of_ours():
    assert {b for a, bs in graph().items() if a.startswith("experiments") for b in bs} <= {"experiments"}


def test_the_checks_see_a_cycle_and_an_upward_import():
    edges = {"engine.a": {"env.b"}, "env.b": {"engine.a"}, "rlctl.c": {"engine.a"}}
    assert upward(edges) == [("engine.a", "env.b")]
    assert cycles(edges) == [["engine.a", "env.b"]]
    assert layer("agents.spec") == 3 and layer("experiments") == 0 and "engine.engine" in modules()
