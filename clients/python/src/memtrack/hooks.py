"""memtrack's automatic hooks: phases without code.

Under ``memtrack run`` the job's Python starts with memtrack's
``sitecustomize`` on its path, which calls :func:`install`. It then:

- adds memtrack's callback (memtrack.frameworks) to every transformers
  ``Trainer`` and Lightning ``Trainer`` the job builds, by patching their
  ``__init__`` when their module is first imported (nothing is imported
  ahead of the job);
- announces the job's own ClearML task the moment ``Task.init`` (or
  ``Task.current_task``, which makes one in a subprocess) returns it, so
  that memtrack reports into that task instead of making its own;
- announces the job's own MLflow run the moment ``mlflow.start_run``
  returns it (autolog and the Trainer integrations start theirs through
  it too), so that memtrack's figures go into that run; a nested run is
  not announced, its parent holds the job's memory;
- reports an uncaught CUDA out-of-memory error (torch) or MemoryError to
  memtrack before Python's usual handling (``sys.excepthook`` and
  ``threading.excepthook``, chained).

It never breaks a job: a framework whose API is not the expected one, or
any error inside a hook, is said once on stderr and the job goes on
without that hook. ``MEMTRACK_AUTO_HOOKS=0`` turns all of it off.
"""

import sys
import threading

from .client import _env_flag, install_oom_hook

__all__ = ["install", "disabled"]

# Module imported -> what to patch once it has run.
_TARGETS = {
    "transformers.trainer": "transformers",
    "lightning.pytorch.trainer.trainer": "lightning.pytorch",
    "pytorch_lightning.trainer.trainer": "pytorch_lightning",
    "clearml.task": "clearml",
    "mlflow.tracking.fluent": "mlflow",
}
_said = set()
_installed = False
_lock = threading.Lock()


def disabled():
    """Whether ``MEMTRACK_AUTO_HOOKS`` turns the hooks off (0, false, no, off)."""
    import os

    value = os.environ.get("MEMTRACK_AUTO_HOOKS", "").strip().lower()
    return value in ("0", "false", "no", "off") or _env_flag("MEMTRACK_DISABLE")


def _say_once(key, text):
    if key in _said:
        return
    _said.add(key)
    try:
        sys.stderr.write("memtrack: %s\n" % text)
        sys.stderr.flush()
    except Exception:
        pass


def _version(top):
    module = sys.modules.get(top)
    return getattr(module, "__version__", "unknown version")


def _accepts(func, name):
    import inspect

    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind == p.VAR_KEYWORD for p in params.values())


def _patch_init(cls, attach, framework, needs):
    """Wrap ``cls.__init__`` so that each built trainer gets ``attach(self)``.
    ``needs`` are attributes the trainer class must have; without them (or
    without a ``callbacks`` parameter) the class is left alone, said once."""
    init = cls.__dict__.get("__init__")
    if init is None or getattr(init, "_memtrack_patched", False):
        return
    missing = [n for n in needs if not hasattr(cls, n)]
    if missing or not _accepts(init, "callbacks"):
        why = "no %s" % ", ".join(missing) if missing else "its __init__ takes no callbacks"
        _say_once(framework, "%s %s: its Trainer is not the one memtrack knows (%s); "
                  "the job runs without memtrack's %s callback"
                  % (framework, _version(framework.split(".")[0]), why, framework))
        return

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        try:
            attach(self)
        except Exception as exc:  # never let telemetry break the job
            _say_once(framework + ".attach", "cannot add memtrack's callback to the %s Trainer "
                      "(%s: %s); the job runs without it" % (framework, type(exc).__name__, exc))

    __init__._memtrack_patched = True
    __init__.__wrapped__ = init
    for attr in ("__name__", "__qualname__", "__doc__", "__module__"):
        try:
            setattr(__init__, attr, getattr(init, attr))
        except Exception:
            pass
    cls.__init__ = __init__


def _copy_names(wrapper, original):
    wrapper.__wrapped__ = original
    for attr in ("__name__", "__qualname__", "__doc__", "__module__"):
        try:
            setattr(wrapper, attr, getattr(original, attr))
        except Exception:
            pass


def _announce_clearml_task(task):
    """Tell memtrack the job's ClearML task (once per task id; the answer is
    awaited by a background thread, never by the job)."""
    try:
        from . import client

        tid = getattr(task, "id", None)
        if tid.__class__ is str and tid and tid != client._clearml_state["task"]:
            client.clearml_announce(tid)
    except Exception as exc:  # never let telemetry break the job
        _say_once("clearml.announce", "cannot tell memtrack the job's ClearML task (%s: %s); "
                  "the job runs on" % (type(exc).__name__, exc))


def _wrap_task_classmethod(cls, name):
    """Replace the classmethod ``cls.name`` by one that announces the task it
    returns. Returns whether it could."""
    raw = cls.__dict__.get(name)
    func = getattr(raw, "__func__", None)
    if not isinstance(raw, classmethod) or func is None or getattr(func, "_memtrack_patched", False):
        return False

    def wrapper(klass, *args, **kwargs):
        task = func(klass, *args, **kwargs)
        if task is not None:
            _announce_clearml_task(task)
        return task

    wrapper._memtrack_patched = True
    _copy_names(wrapper, func)
    setattr(cls, name, classmethod(wrapper))
    return True


def _patch_clearml(module):
    cls = getattr(module, "Task", None)
    if not isinstance(cls, type) or not _wrap_task_classmethod(cls, "init"):
        _say_once("clearml", "clearml %s: its Task is not the one memtrack knows (no Task.init "
                  "classmethod); call memtrack.clearml_announce() after Task.init to report into "
                  "the job's task" % _version("clearml"))
        return
    # Task.current_task makes a task through cls.init (in a subprocess the
    # main process told of its task), so it announces through this wrapper;
    # it is not wrapped itself: the SDK's forked helpers inherit the main
    # task and must not announce it again.


def _announce_mlflow_run(run):
    try:
        from .client import get_client

        run_id = run.info.run_id
        if run_id:
            get_client().mark("mlflow", "active_run", labels={"run_id": str(run_id)})
    except Exception as exc:  # never let telemetry break the job
        _say_once("mlflow.announce", "cannot tell memtrack the job's MLflow run (%s: %s); "
                  "the job runs on" % (type(exc).__name__, exc))


def _patch_mlflow(module):
    start_run = getattr(module, "start_run", None)
    active_run = getattr(module, "active_run", None)
    if not callable(start_run) or not callable(active_run):
        _say_once("mlflow", "mlflow %s has no start_run/active_run where memtrack looks; call "
                  "memtrack.frameworks.announce_mlflow() inside the run to report into it"
                  % _version("mlflow"))
        return
    if getattr(start_run, "_memtrack_patched", False):
        return

    def wrapper(*args, **kwargs):
        try:
            outer = active_run()
        except Exception:
            outer = None
        run = start_run(*args, **kwargs)
        # A nested run is part of the job; its outermost run holds its memory.
        if outer is None and run is not None:
            _announce_mlflow_run(run)
        return run

    wrapper._memtrack_patched = True
    _copy_names(wrapper, start_run)
    # Set before `mlflow/__init__` imports it from here, and read at call
    # time by the module's own helpers (autolog's managed runs).
    module.start_run = wrapper


def _patch(fullname, module):
    framework = _TARGETS[fullname]
    try:
        if framework == "clearml":
            _patch_clearml(module)
            return
        if framework == "mlflow":
            _patch_mlflow(module)
            return
        from . import frameworks

        cls = getattr(module, "Trainer", None)
        if not isinstance(cls, type):
            _say_once(framework, "%s %s has no Trainer class where memtrack looks; the job "
                      "runs without memtrack's callback" % (framework, _version(framework.split(".")[0])))
            return
        if framework == "transformers":
            _patch_init(cls, frameworks.attach_hf, framework, ("add_callback", "train", "evaluate"))
        else:
            def attach(trainer):
                # Resolved at the first Trainer: the package is complete then.
                frameworks.attach_lightning(trainer, sys.modules.get(framework))

            _patch_init(cls, attach, framework, ("save_checkpoint", "fit"))
    except Exception as exc:
        _say_once(framework, "cannot hook %s (%s: %s); the job runs without memtrack's %s"
                  % (framework, type(exc).__name__, exc,
                     "announcement" if framework in ("clearml", "mlflow") else "callback"))


class _Loader(object):
    """Runs the real loader, then patches the module it made."""

    def __init__(self, loader, fullname):
        self._loader = loader
        self._fullname = fullname

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        try:
            module.__spec__.loader = self._loader
            module.__loader__ = self._loader
        except Exception:
            pass
        self._loader.exec_module(module)
        _patch(self._fullname, module)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _Finder(object):
    """A meta-path finder that only watches the modules in _TARGETS: it asks
    the finders after it for the real spec and wraps its loader."""

    def __init__(self):
        self._busy = threading.local()

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _TARGETS or getattr(self._busy, "on", False):
            return None
        self._busy.on = True
        try:
            spec = None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        except Exception:
            return None
        finally:
            self._busy.on = False
        loader = getattr(spec, "loader", None)
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            return spec
        spec.loader = _Loader(loader, fullname)
        return spec

    def invalidate_caches(self):
        pass


def install():
    """Install the automatic hooks (once per process): the framework
    callbacks and the out-of-memory report. Nothing when disabled."""
    global _installed
    with _lock:
        if _installed or disabled():
            return
        _installed = True
    try:
        install_oom_hook()
    except Exception as exc:
        _say_once("oom", "cannot install the out-of-memory report (%s)" % exc)
    sys.meta_path.insert(0, _Finder())
    # A framework imported before the hooks (rare: a .pth file) is patched now.
    for fullname in _TARGETS:
        module = sys.modules.get(fullname)
        if module is not None:
            _patch(fullname, module)
