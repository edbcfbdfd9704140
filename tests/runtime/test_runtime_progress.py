"""The compile progress bar: shown on a terminal for many fragments, silent otherwise."""

import sys

import jax.numpy as jnp

import mpmdc


def eight_distinct_fragments(meshes2):
    def fn(x):
        for i in range(8):
            x = mpmdc.stage(x, i) * (i + 2.0)  # a different constant: a different body
        return x

    return mpmdc.compile(fn, meshes2, stage_to_mesh=(0, 1) * 4).lower(jnp.ones(4))


def test_progress_bar_on_a_terminal(meshes2, capsys, monkeypatch):
    lowered = eight_distinct_fragments(meshes2)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    executable = lowered.compile()
    assert executable.num_executables == 8
    assert "mpmdc: compiling fragments" in capsys.readouterr().err


def test_no_progress_bar_when_not_a_terminal(meshes2, capsys):
    executable = eight_distinct_fragments(meshes2).compile()
    assert executable.num_executables == 8
    assert capsys.readouterr().err == ""
