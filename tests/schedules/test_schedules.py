"""Schedules, their validation against data dependencies, the simulator and ``mpmdc schedule``."""

import json
import re

import pytest

from mpmdc import cli, schedules
from mpmdc.errors import ScheduleError
from mpmdc.schedules import Action, ActionLists, Layout, bubble_formula, simulate


def timeline(name, stages, microbatches, meshes=None, costs=None):
    layout = Layout.make(stages, microbatches, num_meshes=meshes)
    return simulate(schedules.get(name).actions(layout), layout, costs)


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
        (["0F0 0F1 0B0 0B1 0F1", "1F0 1B0 1F1 1B1"], "0F1 is listed twice"),
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
        (42, Layout.make(2, 2), "got int"),
    ],
)
def test_schedule_choice_errors(schedule, layout, says):
    with pytest.raises(ScheduleError, match=re.escape(says)):
        schedules.get(schedule).actions(layout)


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
    assert cli.main(["schedule", "--schedule", "nope", "--stages", "4", "--microbatches", "8"]) == 2
    assert "known schedules" in capsys.readouterr().err
    assert cli.main(["schedule", "--stages", "4", "--microbatches", "8", "--costs", "F=fast"]) == 2
