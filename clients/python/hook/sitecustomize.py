"""memtrack's automatic hooks, put on a job's PYTHONPATH by `memtrack run`.

Python imports the first ``sitecustomize`` on its path at start-up; this one
installs memtrack.hooks (framework callbacks, out-of-memory report) and then
runs the ``sitecustomize`` that would have run without memtrack, if any.
``MEMTRACK_AUTO_HOOKS=0`` (or ``memtrack run --no-auto-hooks``) turns the
hooks off. Nothing here may stop the job: every failure is one line on
stderr.
"""


def _memtrack_boot():
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    if os.environ.get("MEMTRACK_AUTO_HOOKS", "").strip().lower() not in ("0", "false", "no", "off"):
        try:
            import importlib.util

            if importlib.util.find_spec("memtrack") is None:
                # No installed client: the copy memtrack wrote beside this
                # file, loaded as a package without adding its folder to
                # sys.path (see _leave_sys_path).
                package = os.path.join(here, "client", "memtrack")
                spec = importlib.util.spec_from_file_location(
                    "memtrack", os.path.join(package, "__init__.py"),
                    submodule_search_locations=[package])
                module = importlib.util.module_from_spec(spec)
                sys.modules["memtrack"] = module
                try:
                    spec.loader.exec_module(module)
                except BaseException:
                    del sys.modules["memtrack"]
                    raise
            import memtrack.hooks

            memtrack.hooks.install()
        except Exception as exc:
            try:
                sys.stderr.write("memtrack: automatic hooks not installed (%s: %s)\n"
                                 % (type(exc).__name__, exc))
            except Exception:
                pass
    # Chain to the sitecustomize this one shadows.
    try:
        import importlib.machinery
        import importlib.util

        mine = os.path.realpath(here)
        rest = [p for p in sys.path if os.path.realpath(p or os.curdir) != mine]
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
        if spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            sys.modules["sitecustomize"] = module
            spec.loader.exec_module(module)
    except Exception:
        import traceback

        try:
            sys.stderr.write("memtrack: the job's own sitecustomize failed:\n")
            traceback.print_exc()
        except Exception:
            pass
    _leave_sys_path(here)


def _leave_sys_path(here):
    """Take this folder off sys.path once it has done its work (it stays in
    PYTHONPATH, so the job's child processes run it too). Every import of a
    module that does not exist looks in each folder of sys.path, and
    libraries do that on their hot paths (transformers looks for an optional
    optimizer package twice a training step): each extra folder is a stat
    the job pays at every such import."""
    import os
    import sys

    try:
        mine = os.path.realpath(here)
        sys.path[:] = [p for p in sys.path if not p or os.path.realpath(p) != mine]
    except Exception:
        pass


_memtrack_boot()
del _memtrack_boot, _leave_sys_path
