"""Schedules, their validation against data dependencies, the simulator and ``mpmdc schedule``."""

import itertools
import json
import re

import numpy as np
import pytest

from mpmdc import cli, schedules
from mpmdc.errors import ScheduleError
from mpmdc.schedules import (
    Action,
    ActionLists,
    Layout,
    bubble_formula,
    bubble_time_formula,
    formula_holds,
    in_flight,
    simulate,
    steady_bubble,
    v_placement,
)


def timeline(name, stages, microbatches, meshes=None, costs=None):
    layout = Layout.make(stages, microbatches, num_meshes=meshes)
    return simulate(schedules.get(name).actions(layout), layout, costs)


def planned(name, p, m):
    """``(action lists, layout)`` of schedule ``name`` on ``p`` meshes: one stage per mesh,
    or two (round robin for interleaved, the V for the V schedules)."""
    schedule = schedules.get(name)
    n = 2 * p if name in ("interleaved-1f1b", "zb-v", "dualpipev") else p
    layout = Layout.make(n, m, schedule.placement(n, p), num_meshes=p)
    return schedule.actions(layout), layout


# Costs of one stage's F, I and W (B = I + W for the schedules that do not split it).
EQUAL = {"F": 1, "I": 1, "W": 1}
COSTS = [EQUAL, {"F": 1, "I": 1, "W": 0.5}, {"F": 2, "I": 1, "W": 1}, {"F": 1.5, "I": 1, "W": 0.7}]
COSTS_I_ABOVE_F = [{"F": 1, "I": 2, "W": 1}, {"F": 1, "I": 1.5, "W": 0.5}, {"F": 1, "I": 2, "W": 2}]
COSTS_W_ABOVE_F = [{"F": 1, "I": 1, "W": 1.5}]


def with_whole_backward(name, costs):
    return {"F": costs["F"], "B": costs["I"] + costs["W"]} if name in WHOLE else costs


WHOLE = ("gpipe", "1f1b", "interleaved-1f1b")
EQUAL_F_AND_I = [{"F": 2, "I": 2, "W": 1}, {"F": 1.5, "I": 1.5, "W": 0.2}]
ALL_COSTS = COSTS + COSTS_I_ABOVE_F + COSTS_W_ABOVE_F + EQUAL_F_AND_I
# Each formula on every cost set in its domain (see ``bubble_time_formula``).
FORMULA_HOLDS = {
    name: [c for c in ALL_COSTS if formula_holds(name, c)]
    for name in ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v")
}
MESHES_AND_MICROBATCHES = [(1, 2), (2, 4), (2, 7), (3, 6), (4, 8), (4, 16), (6, 12), (8, 17)]


@pytest.mark.parametrize("name", sorted(FORMULA_HOLDS))
@pytest.mark.parametrize(("p", "m"), MESHES_AND_MICROBATCHES)
@pytest.mark.slow
def test_steady_bubble_is_the_published_formula(name, p, m):
    """Steps back to back, each mesh idles per step what the schedule's paper says."""
    if name == "interleaved-1f1b" and m % p:
        m = m // p * p
    per_mesh, layout = planned(name, p, m)
    assert len(FORMULA_HOLDS[name]) >= 4
    for costs in FORMULA_HOLDS[name]:
        got = steady_bubble(per_mesh, layout, with_whole_backward(name, costs))
        assert got == pytest.approx(bubble_time_formula(name, p, costs), abs=1e-9), costs


@pytest.mark.parametrize(("p", "m"), MESHES_AND_MICROBATCHES)
def test_dualpipev_bubble_is_at_most_the_published_formula(p, m):
    """DualPipe's formula counts a forward and a backward overlapped in one call; run one
    after the other, the pair's halves start when their own inputs are there, and the
    bubble is at most the formula's where it holds (``W <= F <= I``)."""
    per_mesh, layout = planned("dualpipev", p, max(m, 2 * p))
    domain = [c for c in COSTS + COSTS_I_ABOVE_F + COSTS_W_ABOVE_F if formula_holds("dualpipev", c)]
    assert len(domain) >= 3
    for costs in domain:
        got = steady_bubble(per_mesh, layout, costs)
        assert got <= bubble_time_formula("dualpipev", p, costs) + 1e-9, costs


@pytest.mark.parametrize("seed", range(6))
def test_formula_domains_hold_on_random_costs(seed):
    """Random costs, meshes and microbatches: where ``formula_holds``, the steady bubble
    is the formula (ZB-H1, ZB-H2, ZB-V) or at most it (DualPipeV)."""
    rng = np.random.default_rng(seed)
    for _ in range(8):
        p = int(rng.integers(2, 6))
        m = int(rng.integers(2 * p, 4 * p))
        costs = {k: float(rng.choice([0.5, 1, 1.5, 2, 3])) for k in "FIW"}
        if rng.random() < 0.5:
            costs["I"] = costs["F"]
        for name in ("zb-h1", "zb-h2", "zb-v", "dualpipev"):
            if not formula_holds(name, costs):
                continue
            per_mesh, layout = planned(name, p, m)
            got, formula = (
                steady_bubble(per_mesh, layout, costs),
                bubble_time_formula(name, p, costs),
            )
            if name == "dualpipev":
                assert got <= formula + 1e-9, (name, p, m, costs)
            else:
                assert got == pytest.approx(formula, abs=1e-9), (name, p, m, costs)


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-h2", "zb-v"])
def test_the_formulas_need_enough_microbatches_to_fill_the_pipeline(name):
    """With fewer microbatches than fill the pipeline the steady bubble is more than the
    published figure: ``formula_holds`` given the meshes and microbatches says where the
    figure is met, and is tight (one microbatch fewer, it is not)."""
    costs = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
    for p in (2, 3, 4):
        held = []
        for m in range(1, 2 * p + 2):
            try:
                per_mesh, layout = planned(name, p, m)
            except ScheduleError:
                continue  # (a layout the schedule cannot run)
            met = steady_bubble(per_mesh, layout, costs) == pytest.approx(
                bubble_time_formula(name, p, costs), abs=1e-9
            )
            assert met == formula_holds(name, costs, p, m), (name, p, m)
            held.append(met)
        assert any(held)


@pytest.mark.parametrize(("p", "m"), MESHES_AND_MICROBATCHES)
def test_peak_in_flight_is_the_published_count(p, m):
    """Microbatches' stage activations held at once per mesh: 1F1B p - s, ZB-H1 p, ZB-H2
    2p - 1 (twice 1F1B), ZB-V 2p stages of half the size (1F1B's memory), DualPipeV 2p + 1."""
    want = {
        "1f1b": [min(m, p - s) for s in range(p)],
        "zb-h1": [min(m, p)] * p,
        "zb-h2": [min(m, 2 * p - 1)] * p,
        "zb-v": [2 * p] * p,
        "dualpipev": [2 * p + 1] * p,
    }
    for name, peaks in want.items():
        m_ = max(m, 2 * p) if name in ("zb-v", "dualpipev") else m
        assert list(in_flight(planned(name, p, m_)[0])) == peaks, name


@pytest.mark.parametrize("name", ["zb-h2", "zb-v"])
@pytest.mark.parametrize(("p", "m"), MESHES_AND_MICROBATCHES)
def test_zero_bubble_schedules_keep_every_mesh_busy_from_first_to_last_action(name, p, m):
    """At equal costs a mesh never waits between its first and its last action (the
    paper's parallelogram): one step's only idle time is the fill and the drain."""
    per_mesh, layout = planned(name, p, max(m, 2 * p - 1))
    for row in simulate(per_mesh, layout, EQUAL).meshes:
        assert all(a.end == b.start for a, b in itertools.pairwise(row))


def test_dualpipev_runs_deepseeks_eight_phases():
    """Two meshes, four microbatches, written out by hand from DualPipeV's phases: mesh 0
    (stages 0 and 3) warms up with 2 forwards of stage 0; ...; its second half of
    backwards defers the weight gradients to the end."""
    per_mesh, layout = planned("dualpipev", 2, 4)
    assert layout.stage_to_mesh == (0, 1, 1, 0)
    assert [" ".join(map(str, row)) for row in per_mesh] == [
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3I1 3W1 3F2 0I0 0W0 3I2 3W2 3F3 0I1 0W1 "
        "3I3 3W3 0I2 0W2 0I3 0W3",
        "1F0 2F0 1F1 2F1 1F2 2I0 2W0 2F2 1I0 1W0 1F3 2I1 2W1 2F3 1I1 1W1 "
        "2I2 2W2 1I2 1W2 2I3 1I3 2W3 1W3",
    ]


def test_zb_v_runs_its_warm_up_steady_and_cool_down_phases():
    """Two meshes, three microbatches: mesh 0 warms up with 3 forwards of stage 0, runs
    stage 3's F I W twice, then steady rounds; mesh 1 alternates its stages' forwards once
    first. Input gradients go before the deferred weight gradients at the end."""
    per_mesh, _ = planned("zb-v", 2, 3)
    assert [" ".join(map(str, row)) for row in per_mesh] == [
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0 3F2 3I2 3W2 0I1 0W1 0I2 0W2",
        "1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1I1 2I2 1I2 1W1 2W2 1W2",
    ]


def test_the_v_schedules_place_stages_s_and_2M_minus_1_minus_s_on_mesh_s():
    assert v_placement(4) == (0, 1, 2, 3, 3, 2, 1, 0)
    for name in ("zb-v", "dualpipev"):
        assert schedules.get(name).placement(8, 4) == v_placement(4)
        assert schedules.get(name).placement(4, 4) is None  # not 2M stages: no V to make
    assert schedules.get("1f1b").placement(4, 4) is None


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [1, 2, 4])
@pytest.mark.parametrize("m", [1, 4, 8])
@pytest.mark.parametrize("costs", [None, {"F": 1, "B": 1}, {"F": 1, "B": 3}])
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(name, p, m, costs):
    assert timeline(name, p, m, costs=costs).bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize(("p", "v", "m"), [(2, 2, 4), (4, 2, 4), (4, 2, 8), (4, 3, 8), (2, 4, 6)])
def test_interleaved_bubble_is_p_minus_1_over_vm_plus_p_minus_1(p, v, m):
    got = timeline("interleaved-1f1b", p * v, m, meshes=p).bubble_fraction
    assert got == pytest.approx((p - 1) / (v * m + p - 1))
    assert got == pytest.approx(bubble_formula("interleaved-1f1b", p, m, v))


@pytest.mark.parametrize(("p", "m"), [(2, 2), (2, 8), (4, 4), (4, 8), (6, 12), (8, 8)])
def test_zb_h1_bubble_is_at_most_a_third_of_1f1b_at_equal_f_i_w_cost(p, m):
    equal = {"F": 1, "I": 1, "W": 1, "B": 2}  # B is I + W
    zb, one_f_one_b = timeline("zb-h1", p, m, costs=equal), timeline("1f1b", p, m, costs=equal)
    assert zb.bubble_time <= one_f_one_b.bubble_time / 3 + 1e-9
    assert zb.bubble_fraction < one_f_one_b.bubble_fraction or p == 1


def test_1f1b_holds_at_most_p_minus_s_microbatches_and_gpipe_all():
    layout = Layout.make(4, 8)
    for name, limit in (("1f1b", lambda s: 4 - s), ("gpipe", lambda s: 8)):
        for s, actions in enumerate(schedules.get(name).actions(layout)):
            in_flight = peak = 0
            for a in actions:
                in_flight += 1 if a.kind == "F" else -1
                peak = max(peak, in_flight)
            assert peak == limit(s), (name, s)


def test_action_text_round_trip_and_user_lists():
    assert str(Action.parse(" 12W3 ")) == "12W3"
    layout = Layout.make(2, 2)
    lists = schedules.get("1f1b").actions(layout)
    user = schedules.get([" ".join(map(str, actions)) for actions in lists])
    assert isinstance(user, ActionLists) and user.actions(layout) == lists
    assert simulate(user.actions(layout), layout).makespan == timeline("1f1b", 2, 2).makespan


@pytest.mark.parametrize(
    ("lists", "says"),
    [
        (
            ["0F0 0B0 0F1 0B1", "1F1 1B1 1F0 1B0"],
            "deadlocks: mesh 0 waits at 0B0 for 1B0; mesh 1 waits at 1F1 for 0F1",
        ),
        (["0F0 0F1 0B0 0B1", "1B0 1F0 1F1 1B1"], "breaks a dependency: mesh 1 runs 1B0 before 1F0"),
        (["0F0 0F1 0B0", "1F0 1B0 1F1 1B1"], "never runs 0B1"),
        (["0F0 0F1 0B0 0B1 0F1", "1F0 1B0 1F1 1B1"], "0F1 is listed twice (on mesh 0)"),
        (
            ["0F0 0F1 0B0 0B1 1F0", "1B0 1F1 1B1"],
            "1F0 is listed on mesh 0, but stage 1 runs on mesh 1",
        ),
        (["0F0 0F1 0B0 0B1 0F2", "1F0 1B0 1F1 1B1"], "microbatches 0..1"),
        (["0F0 0F1 0B0 0B1 0I0 0W0", "1F0 1B0 1F1 1B1"], "has both B and I/W"),
        (["0F0 0F1 0B0 0B1"], "1 action list(s) but the pipeline uses 2 meshes"),
        (["0F0 0X1", "1F0"], "'0X1' is not an action"),
    ],
)
def test_bad_schedules_are_named(lists, says):
    layout = Layout.make(2, 2)
    with pytest.raises(ScheduleError, match=re.escape(says)):
        simulate(ActionLists(lists).actions(layout), layout)


@pytest.mark.parametrize(
    ("schedule", "layout", "says"),
    [
        ("zero-bubble", Layout.make(2, 2), "known schedules: gpipe, 1f1b, interleaved-1f1b, zb-h1"),
        (
            "1f1b",
            Layout.make(8, 8, num_meshes=4),
            "for 8 stages on 4 meshes use mpmdc.compile(..., schedule='interleaved-1f1b')",
        ),
        ("1f1b", Layout.make(4, 4, (0, 0, 1, 1)), "use mpmdc.compile(..., schedule='gpipe')"),
        ("zb-h1", Layout.make(8, 8, num_meshes=4), "zb-h1 runs exactly one stage per mesh"),
        (
            "interleaved-1f1b",
            Layout.make(8, 6, num_meshes=4),
            "6 microbatches is not a multiple of 4",
        ),
        ("interleaved-1f1b", Layout.make(4, 4, (0, 1, 1, 0)), "needs stage s on mesh s mod 2"),
        ("zb-h2", Layout.make(8, 8, num_meshes=4), "zb-h2 runs exactly one stage per mesh"),
        (
            "zb-v",
            Layout.make(8, 8, num_meshes=4),
            "zb-v runs two stages per mesh in V order: 8 stages on 4 meshes, stages s and 7-s "
            "on mesh s (stage_to_mesh=[0, 1, 2, 3, 3, 2, 1, 0], the default for this "
            "schedule); got 8 stages with stage_to_mesh=[0, 1, 2, 3, 0, 1, 2, 3]",
        ),
        ("dualpipev", Layout.make(4, 8), "mark 8 stages, or use a schedule of one stage per mesh"),
        (
            "dualpipev",
            Layout.make(8, 6, v_placement(4)),
            "dualpipev on 4 meshes needs at least 8 microbatches (its warm-up fills the "
            "pipeline), got 6",
        ),
        ("zb-v", Layout.make(4, 2, v_placement(2)), "zb-v on 2 meshes needs at least 3"),
        (42, Layout.make(2, 2), "got int"),
    ],
)
def test_schedule_choice_errors(schedule, layout, says):
    with pytest.raises(ScheduleError, match=re.escape(says)):
        schedules.get(schedule).actions(layout)


@pytest.mark.parametrize(
    ("schedule", "says"),
    [
        ([0, 1], "schedule=[0, 1] is not per-mesh action lists: mesh 0's entry is 0, of type int"),
        ((0, 1), "mesh 0's entry is 0, of type int"),
        (["0F0 0B0", None], "mesh 1's entry is None, of type NoneType"),
        ([[0, 1], [1]], "0 is not an action"),
        ([[Action(0, "F", 0), 3], []], "3 is not an action"),
    ],
)
def test_action_lists_of_other_things_are_named(schedule, says):
    """Per-mesh action lists hold, per mesh, a string of actions or a sequence of actions
    (objects or text); anything else (a list of ints, which looks like stage_to_mesh) is a
    ``ScheduleError`` naming the entry, not a ``TypeError``."""
    with pytest.raises(ScheduleError, match=re.escape(says)):
        schedules.get(schedule)


def test_action_lists_not_in_a_list_and_actions_of_unknown_kinds_are_named():
    with pytest.raises(ScheduleError, match=re.escape("use mpmdc.compile(..., stage_to_mesh=...)")):
        ActionLists(5)
    with pytest.raises(ScheduleError, match="'Q' is not an action kind; use one of F, B, I, W"):
        Action(0, "Q", 0)


def test_layout_errors():
    with pytest.raises(ScheduleError, match="at least one stage and one microbatch"):
        Layout.make(4, 0)
    with pytest.raises(ScheduleError, match="3 entries for 4 stages"):
        Layout.make(4, 2, (0, 1, 2))


def test_timeline_ascii_and_chrome_trace():
    t = timeline("1f1b", 2, 2)
    rows = t.ascii().splitlines()
    assert [r.split("|")[0] for r in rows] == ["mesh0 ", "mesh1 "]
    assert "0F0" in rows[0] and "1B1" in rows[1] and "." in rows[0]
    trace = json.loads(t.chrome_trace())["traceEvents"]
    slots = [e for e in trace if e["ph"] == "X"]
    assert len(slots) == 8 and {e["tid"] for e in slots} == {0, 1}
    last = max(slots, key=lambda e: e["ts"] + e["dur"])
    assert last["ts"] + last["dur"] == pytest.approx(t.makespan * 1000)


def test_a_timelines_repr_is_a_summary_that_points_to_ascii():
    t = timeline("1f1b", 8, 32)  # 512 slots
    assert t.busy_times == (96.0,) * 8  # 32 forwards (1) and backwards (2) per mesh
    assert repr(t) == (
        "Timeline(makespan=117, bubble_fraction=0.179, busy_times=(96, 96, 96, 96, 96, 96, "
        "96, 96), 512 slots on 8 meshes; .ascii() draws them)"
    )


def test_schedule_command(capsys, tmp_path):
    png, trace = tmp_path / "t.png", tmp_path / "t.json"
    status = cli.main(
        [
            "schedule",
            "--schedule",
            "1f1b",
            "--stages",
            "4",
            "--microbatches",
            "8",
            "--png",
            str(png),
            "--trace",
            str(trace),
        ]
    )
    out = capsys.readouterr().out
    assert status == 0
    assert "bubble fraction 0.2727 (formula (p-1)/(v*m+p-1) = 0.2727)" in out
    assert out.count("\nmesh") == 4
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(trace.read_text())["traceEvents"]
    for schedule, stages, says in (
        ("zb-v", "8", "bubble 0 per mesh and step (published formula 0)"),
        ("auto", "4", "auto chose zb-h2: step 24, bubble 0 per mesh"),
    ):
        argv = ["schedule", "--schedule", schedule, "--stages", stages, "--meshes", "4"]
        assert cli.main([*argv, "--microbatches", "8", "--costs", "F=1,I=1,W=1"]) == 0
        assert says in capsys.readouterr().out
    for bad in ("X=1", "W=-1", "F=fast"):
        assert cli.main(["schedule", "--stages", "4", "--microbatches", "8", "--costs", bad]) == 2
        assert "is not KIND=NUMBER" in capsys.readouterr().err
    # I and W without B: B is their sum (1F1B pays for the work the split schedules do).
    assert cli.main(["schedule", "--stages", "4", "--microbatches", "8", "--costs", "I=2,W=2"]) == 0
    assert "costs F=1 B=4 I=2 W=2" in capsys.readouterr().out
    assert cli.main(["schedule", "--schedule", "nope", "--stages", "4", "--microbatches", "8"]) == 2
    assert "known schedules" in capsys.readouterr().err
    # The library's advice names compile's argument; the command names its own flag.
    argv = ["schedule", "--schedule", "1f1b", "--stages", "8", "--meshes", "4"]
    assert cli.main([*argv, "--microbatches", "8"]) == 2
    err = capsys.readouterr().err
    assert "use --schedule interleaved-1f1b, or --schedule gpipe, which" in err
    assert "mpmdc.compile" not in err and "schedule='" not in err
    assert cli.main(["schedule", "--stages", "4", "--microbatches", "8", "--costs", "F=fast"]) == 2
