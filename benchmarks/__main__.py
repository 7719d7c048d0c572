"""``python -m benchmarks <op> [options]``: pin the threads, import the op, run it, save.

The thread count is read from the command line and the process pinned
(:func:`benchmarks.harness.pin_threads`) *before* any op module is imported,
since op modules may import JAX (whose CPU thread pool is sized when it starts).
Op modules are imported one by one: a module that is absent or fails to import
leaves the other ops working (it is reported on stderr, and running that op
shows the error).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from benchmarks import harness

# op modules in the order of `--help`
OP_MODULES = ("dilated", "ring", "distributed", "block_sparse", "strategies", "packed", "window",
              "gpu", "lm", "slide", "dense")


def _threads_from(argv: list[str]) -> int:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--threads", type=int, default=2)
    args, _ = pre.parse_known_args(argv)
    return args.threads


def _import_ops(wanted: str | None) -> dict[str, BaseException]:
    """Import the op modules (they register themselves); {module: error} of failures."""
    failed = {}
    for name in OP_MODULES:
        try:
            importlib.import_module(f"benchmarks.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"benchmarks.{name}":
                failed[name] = err
        except Exception as err:  # noqa: BLE001 - one broken op must not hide the others
            failed[name] = err
    for name, err in failed.items():
        if wanted in (None, name):
            print(f"benchmarks.{name} could not be imported: {type(err).__name__}: {err}",
                  file=sys.stderr)
    return failed


def build_parser() -> argparse.ArgumentParser:
    import benchmarks
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=benchmarks.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="op", required=True, metavar="OP")
    for op in harness.OPS.values():
        p = sub.add_parser(op.name, help=op.help, description=op.help)
        op.add_arguments(p)
        harness.add_common_arguments(p, op)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    threads = harness.pin_threads(_threads_from(argv))
    wanted = next((a for a in argv if not a.startswith("-")), None)
    failed = _import_ops(wanted)
    if wanted in failed:
        raise failed[wanted]
    args = build_parser().parse_args(argv)
    op = harness.OPS[args.op]
    args.threads = threads
    harness.resolve_common(args, op)
    args.load = harness.LoadMonitor(threads)
    payload = op.run(args)
    path = harness.write_json(args.json, payload)
    print(f"results written to {path}")
    if not args.no_plot:
        try:
            from benchmarks import plots
            for png in plots.plot(payload, path):
                print(f"plot written to {png}")
        except ImportError as err:
            print(f"no plot ({err}; pip install matplotlib)")
    warning = args.load.warning()
    if warning:
        print(warning)
    return 0


if __name__ == "__main__":
    sys.exit(main())
