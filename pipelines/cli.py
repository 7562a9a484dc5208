"""The ``difforge`` command: one subcommand per stage, plus ``run`` for a whole pipeline.

    difforge <stage> [CONFIG.yml] [key=value ...] [--dry-run] [--force] [-v]
    difforge fit train|generate [key=value ...] [--json]

Each stage is registered by the import paths of its config dataclass and its ``run`` function,
so ``difforge --help`` never imports JAX or TensorFlow. User errors (bad config, missing
artifact, mismatched weights, bad prompt file) print one line naming the problem and exit 2;
a stage stopped by SIGTERM (preemption) after keeping what it finished exits 75
(:data:`stages.common.preemption.EXIT_PREEMPTED`: rerun to resume); anything else is a bug and
keeps its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import re
import sys
from collections.abc import Sequence

from pipelines.registry import STAGE_NAMES, STAGES, load_entry
from stages.common.preemption import EXIT_PREEMPTED, Preempted  # light: no JAX


def user_error_types() -> tuple[type[BaseException], ...]:
    """Exceptions that mean 'the user asked for something wrong', not 'difforge is broken'."""
    from jaxcore.artifacts import ArtifactError
    from jaxcore.config import ConfigError
    from jaxcore.storage import StorageError

    types: list[type[BaseException]] = [ConfigError, ArtifactError, StorageError]
    for path in (
        "jaxcore.weights:WeightsError",
        "jaxcore.sharding:ShardingError",
        "pipelines.demo.run:DemoCheckError",
    ):
        with contextlib.suppress(ImportError, AttributeError):
            types.append(load_entry(path))
    try:
        from stages.common.errors import StageInputError

        types.append(StageInputError)
    except ImportError:
        pass
    return tuple(types)


def setup_logging(verbose: int) -> None:
    level = logging.DEBUG if verbose > 1 else logging.INFO if verbose >= 0 else logging.WARNING
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    for noisy in ("absl", "jax._src", "urllib3", "google", "apache_beam", "tensorflow", "h5py"):
        logging.getLogger(noisy).setLevel(max(level, logging.WARNING))
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


# jaxlib releases whose XLA CPU runs bf16 products far slower than their neighbours: 0.12.1 at
# 278 GFLOP/s where 0.12.0.1 reaches 1,346 (4096^2, bf16 in, float32 out, a 2-core AMX host)
SLOW_CPU_JAXLIB = {"0.12.1": "0.12.0.1"}


def warn_about_slow_cpu_jaxlib() -> None:
    """One warning line when this host runs JAX on the CPU with a jaxlib in
    :data:`SLOW_CPU_JAXLIB` (judged without starting JAX)."""
    import jaxlib

    from jaxcore.host_memory import accelerator_present

    better = SLOW_CPU_JAXLIB.get(jaxlib.__version__)
    if better and not accelerator_present():
        logging.getLogger("difforge").warning(
            "jaxlib %s runs bf16 products on the CPU ~5x slower than %s; for CPU runs: "
            "pip install jax==%s jaxlib==%s",
            jaxlib.__version__,
            better,
            better,
            better,
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="difforge",
        description="difforge: latent diffusion stages (convert, train, evaluate, generate) "
        "chained through artifacts on a local folder or gs://.",
    )
    sub = parser.add_subparsers(dest="stage", metavar="STAGE", required=True)
    for name, entry in STAGES.items():
        p = sub.add_parser(name, help=entry.summary, description=entry.summary)
        p.add_argument("config", nargs="?", help="YAML config file (configs/stages/<stage>.yml)")
        p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
        p.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
        p.add_argument(
            "--force", action="store_true", help="rebuild even if a finished artifact exists"
        )
        p.add_argument("-v", "--verbose", action="count", default=0)
        p.add_argument("-q", "--quiet", action="store_true")
        if name == "run":
            p.add_argument("--from", dest="from_stage", help="start the chain at this stage")
        if name == "fit":
            p.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


# OS errors that name a condition of the machine (its disk, a quota, permissions), reported
# as one line like a user's error
MACHINE_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EMFILE}
)


def main(argv: Sequence[str] | None = None) -> int:
    from jaxcore.host_memory import keep_freed_host_memory, reexec_with_tcmalloc

    try:
        if argv is None:  # the command itself, not a caller in this process (tests)
            reexec_with_tcmalloc()  # returns where tcmalloc is not wanted or not found
        keep_freed_host_memory()  # before JAX starts its CPU runtime's threads (see the module)
    except ValueError as err:  # a bad DIFFORGE_KEEP_HOST_MEMORY / DIFFORGE_TCMALLOC
        print(f"difforge: error: {err}", file=sys.stderr)
        return 2
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides may also follow flags (`... -q key=value`), which argparse leaves over.
    late = [token for token in extra if "=" in token and not token.startswith("-")]
    if len(late) != len(extra):
        parser.error(f"unrecognized arguments: {' '.join(t for t in extra if t not in late)}")
    # A first positional of the form key=value is an override, not a config file.
    overrides = list(args.overrides) + late
    config_path = args.config
    if config_path and re.match(r"[A-Za-z_][\w.]*=", config_path):
        overrides.insert(0, config_path)
        config_path = None
    if args.stage == "fit":  # `difforge fit train|generate key=value ... [--json]`
        if config_path in ("train", "generate"):
            overrides.insert(0, f"stage={config_path}")
            config_path = None
        if args.json:
            overrides.append("json=true")
    setup_logging(-1 if args.quiet else args.verbose)
    warn_about_slow_cpu_jaxlib()
    entry = STAGES[args.stage]
    errors = user_error_types()
    try:
        from jaxcore.config import load_config, to_yaml

        config = load_config(load_entry(entry.config_class), config_path, overrides)
        if args.dry_run:
            if args.stage == "run":  # a pipeline's dry run resolves every step's config too
                from pipelines.config import load_pipeline_spec

                load_pipeline_spec(config)
            sys.stdout.write(to_yaml(config))
            return 0
        if args.stage in (*STAGE_NAMES, "calibrate"):
            from pipelines.embedded.sources import resolve

            config = resolve(config)  # "tiny" models, "synthetic:" datasets -> local paths
        run = load_entry(entry.run)
        kwargs = {"force": args.force}
        if args.stage == "run":
            kwargs["from_stage"] = args.from_stage
        manifest = run(config, **kwargs)
    except errors as err:
        print(f"difforge {args.stage}: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        if err.errno not in MACHINE_ERRNOS:
            raise
        # a full disk, a quota, a read-only or forbidden folder: the machine's, not a bug;
        # what finished is kept (artifacts commit last), so a rerun resumes once it is mended
        print(f"difforge {args.stage}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"difforge {args.stage}: interrupted", file=sys.stderr)
        return 130
    except Preempted as err:
        print(f"difforge {args.stage}: preempted: {err}", file=sys.stderr)
        return EXIT_PREEMPTED
    if manifest is not None:
        print(f"difforge {args.stage}: artifact {manifest.uri}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
