"""The ``mpmdc`` command line (also ``python -m mpmdc``)."""

from __future__ import annotations

import argparse
import sys


def _demo(args) -> int:
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_platforms", "cpu")
    from mpmdc.demo import run

    worst = run()
    return 0 if worst <= 2e-5 else 1


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``mpmdc`` command."""
    parser = argparse.ArgumentParser(
        prog="mpmdc",
        description="mpmdc: an MPMD compiler middle-end for JAX.",
        epilog="example: mpmdc demo",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="run a 4-stage MLP gradient on 4 meshes of 2 virtual CPU devices",
        description="Compile and run a 4-stage MLP value_and_grad on 8 virtual CPU devices "
        "split into 4 meshes, compare with jax.jit and summarise the fragments.",
    )
    demo.set_defaults(handler=_demo)
    return parser


def main(argv=None) -> int:
    """Entry point of the ``mpmdc`` console script."""
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
