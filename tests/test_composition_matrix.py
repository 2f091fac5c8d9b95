"""The composition matrix: every cell is proven by a test's ``pair`` marker or refused by a row
of `meshtrain.composition.REFUSALS`; the check can fail; the rows name real cells."""

import textwrap
from pathlib import Path

import pytest
from _pair_markers import evidence

from meshtrain.composition import REFUSALS
from meshtrain.composition import matrix as cm

TESTS = Path(__file__).parent


def _explain(cells) -> str:
    """One line per cell: what is missing and what to add."""
    lines = []
    for a, b in cells:
        gap = cm.KNOWN_GAPS.get((a, b))
        why = f"known not to work: {gap}" if gap else "no evidence"
        lines.append(
            f'({a}, {b}): {why}; add an equivalence test marked @pytest.mark.pair("{a}", "{b}"), '
            f'or a REFUSALS row with cells=(("{a}", "{b}"),) saying why'
        )
    return "\n".join(lines)


def test_every_cell_is_proven_or_refused():
    found = evidence(TESTS)
    assert found.bad == [], "\n".join(found.bad)
    missing = cm.missing(found.proofs)
    assert missing == [], f"{len(missing)} cells neither proven nor refused:\n" + _explain(missing)


def test_the_check_names_exactly_the_cell_a_suite_lacks():
    proofs = evidence(TESTS).proofs
    refused = cm.refused()
    assert len(proofs) > 50 and len(refused) > 10
    complete = {c: ["a test"] for c in cm.cells() if c not in refused}
    assert cm.missing(complete) == []
    for drop in (("dp", "tp"), ("packed", "bf16"), ("staleness", "resume-relayout")):
        fewer = {c: t for c, t in complete.items() if c != drop}
        assert cm.missing(fewer) == [drop]
    # a refused cell is settled by its row, and missing again without it
    row = next(r for r in REFUSALS if ("cudnn", "ring") in r.cells)
    cudnn = [cm.cell(*c) for c in row.cells]  # cuDNN beside ring and all-gather
    assert set(cudnn) <= set(refused) and not set(cudnn) & set(complete)
    rows = [r for r in REFUSALS if r is not row]
    assert sorted(cm.missing(complete, rows)) == sorted(cudnn)


def test_markers_are_read_from_decorators_params_and_names(tmp_path):
    (tmp_path / "test_x.py").write_text(
        textwrap.dedent(
            """
            import pytest

            pair = pytest.mark.pair
            RING = pytest.mark.pair("packed", "ring")
            CASES = [pytest.param(1, marks=pytest.mark.pair("dp", "gpipe")),
                     pytest.param(2, marks=[pair("1f1b", "fsdp"), RING])]

            @pytest.mark.pair("tp", "dp")
            @pytest.mark.parametrize("n", CASES)
            def test_a(n):
                pass

            @pytest.mark.parametrize("m", [pytest.param(0, marks=pair("bf16", "remat"))])
            @RING
            def test_b(m):
                pass

            class TestC:
                @pair("ring", "allgather")
                @pair("dp", "spiral")
                @pair("dp", name)
                def test_c(self):
                    pass

            def build_marks():  # not a test: its marks count for nothing
                pytest.mark.pair("zero1", "remat")

            SCHEDULES = ("gpipe", "1f1b")

            @pytest.mark.parametrize("s, d", [
                pytest.param(s, d, marks=[pytest.mark.pair(f"moe-{d}", s)])
                for s in SCHEDULES for d in ("capacity", "dropless")
            ])
            def test_d(s, d):
                pass

            @pytest.mark.parametrize("a", [
                pytest.param(a, marks=pytest.mark.pair("packed", a)) for a in algorithms()
            ])
            def test_e(a):
                pass

            def case(n, features):
                return pytest.param(n, marks=[pair(a, b) for a, b in combinations(features, 2)])

            @pytest.mark.parametrize("n", [case(1, ("dp", "ulysses", "fp16")), case(2, spec())])
            def test_f(n):
                pass
            """
        )
    )
    found = evidence(tmp_path)
    a, b, d, f = (f"{tmp_path.name}/test_x.py::test_{x}" for x in "abdf")
    assert found.proofs == {
        ("dp", "tp"): [a],
        ("dp", "gpipe"): [a],
        ("fsdp", "1f1b"): [a],
        ("ring", "packed"): [a, b],
        ("remat", "bf16"): [b],
        ("gpipe", "moe-capacity"): [d],
        ("gpipe", "moe-dropless"): [d],
        ("1f1b", "moe-capacity"): [d],
        ("1f1b", "moe-dropless"): [d],
        ("dp", "ulysses"): [f],
        ("dp", "fp16"): [f],
        ("ulysses", "fp16"): [f],
    }
    assert len(found.bad) == 5, found.bad
    assert all("test_x.py::test_c" in line for line in found.bad[:3])
    assert "one run has only one of them" in found.bad[0]
    assert "'spiral': not a feature id" in found.bad[1]
    assert "pair('dp', name): give exactly two feature ids as literal strings" in found.bad[2]
    assert "test_x.py::test_e: pair('packed', a): give exactly two" in found.bad[3]
    assert "test_x.py::test_f: pair(a, b): give exactly two" in found.bad[4]  # unread argument


def test_every_refusal_row_names_real_cells():
    named = 0
    for row in REFUSALS:
        for a, b in row.cells + row.touches:
            cm.cell(a, b)  # raises on an unknown id or a pair that is not a cell
            named += 1
    assert named >= 20


def test_known_gaps_and_exclusive_groups_are_cells_of_the_vocabulary():
    for a, b in cm.KNOWN_GAPS:
        assert cm.cell(a, b) == (a, b)
    grouped = set().union(*cm.EXCLUSIVE)
    assert grouped <= set(cm.FEATURES) and "tp" not in grouped
    assert cm.cell("tp", "dp") == ("dp", "tp")
    with pytest.raises(ValueError, match="only one of them"):
        cm.cell("gpipe", "1f1b")
    n = len(cm.FEATURES)
    excluded = sum(len(g) * (len(g) - 1) // 2 for g in cm.EXCLUSIVE)
    assert len(cm.cells()) == n * (n - 1) // 2 - excluded


def test_a_test_removed_leaves_exactly_the_cells_only_it_proved_unproven():
    """Dropping a duplicate proof is safe and dropping a sole one is caught: for every test that
    proves a cell, the suite without it lacks exactly the cells no other test proves."""
    proofs = evidence(TESTS).proofs
    assert cm.missing(proofs) == []
    tests = {t for ts in proofs.values() for t in ts}
    assert len(tests) > 20
    sole_somewhere = 0
    for test in sorted(tests):
        without = {c: [t for t in ts if t != test] for c, ts in proofs.items()}
        without = {c: ts for c, ts in without.items() if ts}
        only = [c for c in cm.cells() if proofs.get(c) == [test]]
        assert cm.missing(without) == only, test
        sole_somewhere += bool(only)
    assert sole_somewhere > 5  # the check is not vacuous: many tests are a cell's only proof


def _page() -> list:
    """The matrix page's nodes, built by the docs' directive from this suite's markers."""
    import sys

    sys.path.insert(0, str(TESTS.parent / "docs" / "_ext"))
    from composition import _status, page

    return page(*_status(), cm.conditions())


def _rows(nodes) -> list[list[str]]:
    """The text of each table row's entries across `nodes`."""
    from docutils import nodes as dn

    return [
        [entry.astext() for entry in row.findall(dn.entry)]
        for node in nodes
        for row in node.findall(dn.row)
    ]


def test_every_refusal_row_with_a_condition_is_on_the_matrix_page_with_it():
    rows = cm.conditions()
    assert len(rows) >= 13 and all(not r.cells for r in rows)
    listed = [tuple(row[:4]) for row in _rows(_page())]
    for r in rows:
        condition = r.second + (" (the default)" if r.by_default else "")
        shown = (r.first, condition, r.reason, r.field.format(model="gpt"))
        assert shown in listed, f"{r.first} with {r.second}: not listed with its condition"


def test_a_pair_refused_at_a_default_setting_shows_as_conditional_not_proven():
    from meshtrain import RunSpec
    from meshtrain.composition import pair_problems
    from meshtrain.composition.examples import run
    from meshtrain.pipeline import PipelineConfig
    from meshtrain.replicas import SyncConfig

    sync = SyncConfig(sync_every=4, outer_optimizer="nesterov")  # DiLoCo
    diloco_zb = RunSpec(
        **run({"pipe": 2, "data": 4}, sync=sync, pipeline=PipelineConfig(schedule="zb-h1"))
    )
    lines = [p.message for p in pair_problems(diloco_zb)]  # every other setting the default
    assert any("global-norm clipping" in line for line in lines), lines
    c = cm.cell("diloco", "zb-h1")
    assert c not in cm.refused() and [r.by_default for r in cm.conditional()[c]] == [True]
    nodes = _page()
    ids = list(cm.FEATURES)
    grid = next(r for r in _rows(nodes[1:2]) if r[0] == "zb-h1")
    assert grid[1 + ids.index("diloco")] == "◐"
    evidence = next(r for r in _rows(nodes) if r[:2] == ["zb-h1", "diloco"])
    assert evidence[2] == "conditional"
    assert "pipelines with global-norm clipping (the default setting" in evidence[3]
