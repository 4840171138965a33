"""Phases from the training frameworks' own hooks: Hugging Face ``Trainer``
and PyTorch Lightning ``Trainer``.

    from memtrack.frameworks import hf_callback, lightning_callback
    trainer = transformers.Trainer(..., callbacks=[hf_callback()])
    trainer = lightning.Trainer(..., callbacks=[lightning_callback()])

Under ``memtrack run`` neither line is needed: the automatic hooks
(``memtrack.hooks``) add these callbacks to every Trainer the job builds.

What is marked:

- each optimizer step: a span ``train``/``step`` whose iteration is the
  global step the optimizer step makes (1 for the first), labelled
  ``batch_size`` (per device), ``grad_accum``, ``world_size`` and ``rank``;
- stages ``fit`` (the whole training), ``evaluate``, ``predict`` (and
  ``test`` for Lightning) and ``save`` (a checkpoint being written), each
  labelled with the ``global_step`` it began at.

Neither library is imported here until a callback is asked for; this
module imports with the standard library alone.
"""

import weakref
from time import time_ns as _time_ns

from . import client as _client
from .client import _FAST_NS, Stage, _check_labels, _prebuilt_head, get_client

__all__ = ["hf_callback", "lightning_callback", "attach_hf", "attach_lightning", "batch_labels",
           "announce_mlflow"]

_COMPONENT = "train"
_OPERATION = "step"
_KINDS = ("span_begin", "span_end")


def batch_labels(batch_size=None, grad_accum=None, world_size=None, rank=None):
    """The labels every step span carries (values that are None are left out)."""
    labels = {}
    for name, value in (("batch_size", batch_size), ("grad_accum", grad_accum),
                        ("world_size", world_size), ("rank", rank)):
        if value is not None:
            labels[name] = str(value)
    return _check_labels(labels)


class _Steps(object):
    """One open ``train``/``step`` span at most. Its two messages are
    prebuilt when the labels are set, so a step costs no JSON encoding
    (``Client._prebuilt``); steps that come less than 10 ms apart are held
    back and sent in batches, each step as one line that says when it began
    and ended (``Client._take_held``). ``begin`` and ``end`` run at every
    step, so a held step costs a handful of attribute reads and an append
    each: whether its batch is due is kept here (when the first step of
    the batch was held, and how many more may wait), not read from the
    client's queue."""

    __slots__ = ("_labels", "_heads", "_began", "_ended", "_held", "_due", "_room", "open_at")

    def __init__(self):
        self.open_at = None
        self._began = self._ended = -1  # when the last begin and end came (ns)
        self._held = None  # the open step's record while its client holds it
        self._due = None  # when the batch of held steps goes (ns); None: none held
        self._room = 0  # how many more steps the batch may hold
        self.labels = {}

    @property
    def labels(self):
        return self._labels

    @labels.setter
    def labels(self, labels):
        self._labels = labels
        self._heads = tuple(_prebuilt_head(kind, self._fields()) for kind in _KINDS)

    def _fields(self, iteration=None):
        fields = {"component": _COMPONENT, "operation": _OPERATION}
        if self._labels:
            fields["labels"] = self._labels
        if iteration is not None:
            fields["iteration"] = iteration
        return fields

    def begin(self, iteration):
        if self.open_at is not None:
            return
        self.open_at = iteration
        now = _time_ns()
        last, self._began = self._began, now
        client = _client._default or get_client()
        if 0 <= now - last < _FAST_NS and not client._cuda and not client._off:
            # Held back as the step's own record, which end() completes.
            step = self._held = [self._heads[0], iteration, now, self._heads[1]]
            client._held.append(step)
            if self._due is None:
                self._due = now + _client._HOLD_NS
                self._room = _client._HOLD_MAX
            return
        self._held = self._due = None
        client._prebuilt(self._heads[0], iteration, "span_begin", self._fields, now, False)

    def end(self):
        iteration = self.open_at
        if iteration is None:
            return
        self.open_at = None
        now = _time_ns()
        last, self._ended = self._ended, now
        step, self._held = self._held, None
        client = _client._default or get_client()
        hold = 0 <= now - last < _FAST_NS
        if step is not None and hold and not client._cuda:
            step.append(now)
            if step[4] is now:
                # The record's line now carries the whole step; the held
                # ones go when due.
                self._room -= 1
                if self._room > 0 and now < self._due:
                    return
                self._due = None
                client._send_held()
                return
        self._due = None
        client._prebuilt(self._heads[1], iteration, "span_end", self._fields, now, hold)


class _Stages(object):
    """Stages opened by name and closed by name (SUCCESS, or FAILED when an
    exception is given)."""

    def __init__(self):
        self.open = {}

    def begin(self, name, step):
        if name in self.open:
            return
        stage = Stage(name, labels={"global_step": str(int(step or 0))})
        self.open[name] = stage
        stage.__enter__()

    def end(self, name, exc=None):
        stage = self.open.pop(name, None)
        if stage is not None:
            if exc is None:
                stage.__exit__(None, None, None)
            else:
                stage.__exit__(type(exc), exc, None)

    def end_all(self, exc=None):
        for name in list(self.open)[::-1]:
            self.end(name, exc)


def announce_mlflow():
    """Tell memtrack the job's active MLflow run (an ``mlflow``/``active_run``
    mark labelled ``run_id``), so that its memory figures go into that run.
    Only when the job already imported mlflow; returns the run id or None."""
    import sys

    mlflow = sys.modules.get("mlflow")
    if mlflow is None:
        return None
    try:
        run = mlflow.active_run()
        run_id = run.info.run_id if run is not None else None
    except Exception:
        return None
    if run_id:
        get_client().mark("mlflow", "active_run", labels={"run_id": str(run_id)})
    return run_id


def _wrap_method(obj, name, stage_name, steps_of):
    """Replace ``obj.name`` (a bound method) by one that runs inside a stage
    of that name; returns whether it could. The stage is labelled with the
    global step at its start (``steps_of(obj)``)."""
    original = getattr(obj, name, None)
    if original is None or not callable(original) or getattr(original, "_memtrack_stage", None):
        return False

    def wrapped(*args, **kwargs):
        try:
            step = steps_of(obj)
        except Exception:
            step = 0
        with Stage(stage_name, labels={"global_step": str(int(step or 0))}):
            return original(*args, **kwargs)

    wrapped._memtrack_stage = stage_name
    try:
        wrapped.__wrapped__ = original
        wrapped.__name__ = getattr(original, "__name__", name)
        wrapped.__doc__ = getattr(original, "__doc__", None)
        setattr(obj, name, wrapped)
    except Exception:
        return False
    return True


# -- Hugging Face transformers ------------------------------------------------

_hf_class = None


def _hf_step(trainer):
    return trainer.state.global_step


def _make_hf_class():
    from transformers import TrainerCallback  # noqa: the caller handles ImportError

    class MemtrackCallback(TrainerCallback):
        """memtrack's phases for a transformers ``Trainer``; see
        memtrack.frameworks."""

        def __init__(self):
            self._steps = _Steps()
            self._stages = _Stages()
            # Set by attach_hf: the trainer's own methods then carry the
            # fit/evaluate/predict/save stages exactly.
            self.attached = False

        def on_train_begin(self, args, state, control, **kwargs):
            self._steps.labels = batch_labels(
                getattr(args, "per_device_train_batch_size", None),
                getattr(args, "gradient_accumulation_steps", None),
                getattr(args, "world_size", None),
                getattr(args, "process_index", None))
            if not self.attached:
                self._stages.begin("fit", state.global_step)
            announce_mlflow()

        def on_step_begin(self, args, state, control, **kwargs):
            self._steps.begin(state.global_step + 1)

        def on_step_end(self, args, state, control, **kwargs):
            self._steps.end()

        def on_prediction_step(self, args, state, control, **kwargs):
            if not self.attached:
                self._stages.begin("evaluate", state.global_step)

        def on_evaluate(self, args, state, control, **kwargs):
            if not self.attached:
                self._stages.end("evaluate")

        def on_predict(self, args, state, control, **kwargs):
            if not self.attached:
                self._stages.end("evaluate")

        def on_save(self, args, state, control, **kwargs):
            if not self.attached:
                get_client().mark("stage", "save", iteration=state.global_step)

        def on_train_end(self, args, state, control, **kwargs):
            self._steps.end()
            if not self.attached:
                self._stages.end_all()

    return MemtrackCallback


def hf_callback():
    """A new ``transformers.TrainerCallback`` marking memtrack's phases
    (ImportError without transformers). Given to ``Trainer(callbacks=[...])``
    it marks steps, ``fit``, ``evaluate`` (from its first prediction step to
    its end) and a ``stage``/``save`` mark after each checkpoint; with
    ``attach_hf(trainer)`` instead, every stage is exact."""
    global _hf_class
    if _hf_class is None:
        _hf_class = _make_hf_class()
    return _hf_class()


def attach_hf(trainer):
    """Give a built transformers ``Trainer`` memtrack's phases: its
    ``train``, ``evaluate``, ``predict`` and checkpoint saves run inside
    stages, and its steps are marked from the trainer's own callback
    handler (see :class:`_HandlerHooks`); where the trainer has not the
    methods memtrack looks for, memtrack's callback is added to its
    callbacks instead. Returns the callback."""
    callback = hf_callback()
    callback.attached = True
    _wrap_method(trainer, "train", "fit", _hf_step)
    _wrap_method(trainer, "evaluate", "evaluate", _hf_step)
    _wrap_method(trainer, "predict", "predict", _hf_step)
    if not _wrap_method(trainer, "_save_checkpoint", "save", _hf_step):
        callback.attached = False  # the stages then come from the callbacks
    if not (callback.attached and _HandlerHooks.attach(getattr(trainer, "callback_handler", None), callback)):
        trainer.add_callback(callback)
    return callback


class _HandlerHooks(object):
    """The steps marked from the trainer's ``CallbackHandler`` itself, with
    memtrack's callback kept out of its list: the handler calls every
    callback in its list for each of a step's four events (step begin, the
    optimizer step's two, step end), each call with eight keyword
    arguments, whether the callback does anything then or not. The
    handler's ``on_train_begin``, ``on_step_begin``, ``on_step_end`` and
    ``on_train_end`` are wrapped on the instance (the callbacks in the list
    are called as before, and see what they saw) and call memtrack's:
    the step begins after the other callbacks' step begin and ends before
    their step end. Used when the stages come from the trainer's own
    methods (``attach_hf``), so that no other event is needed."""

    EVENTS = ("on_train_begin", "on_step_begin", "on_step_end", "on_train_end")

    @classmethod
    def attach(cls, handler, callback):
        """Wraps the handler's four events; False (and nothing changed)
        where it has not all four."""
        originals = [getattr(handler, name, None) for name in cls.EVENTS]
        own = getattr(handler, "__dict__", None)
        if own is None or not all(callable(o) for o in originals):
            return False
        train_begin, step_begin, step_end, train_end = originals
        steps = callback._steps
        begin, end = steps.begin, steps.end

        def on_train_begin(args, state, control, *more, **named):
            control = train_begin(args, state, control, *more, **named)
            callback.on_train_begin(args, state, control)
            return control

        def on_step_begin(args, state, control, *more):
            control = step_begin(args, state, control, *more)
            begin(state.global_step + 1)
            return control

        def on_step_end(args, state, control, *more):
            end()
            return step_end(args, state, control, *more)

        def on_train_end(args, state, control, *more, **named):
            callback.on_train_end(args, state, control)
            return train_end(args, state, control, *more, **named)

        try:
            for name, wrapped in zip(cls.EVENTS, (on_train_begin, on_step_begin, on_step_end, on_train_end)):
                wrapped._memtrack_own = own.get(name, _NOT_OWN)
                wrapped._memtrack_callback = callback
                setattr(handler, name, wrapped)
        except Exception:
            cls.detach(handler)
            return False
        return True

    @classmethod
    def detach(cls, handler):
        """Gives the handler its own four events back."""
        own = getattr(handler, "__dict__", None) or {}
        for name in cls.EVENTS:
            saved = getattr(own.get(name), "_memtrack_own", None)
            if saved is _NOT_OWN:
                del own[name]
            elif saved is not None:
                own[name] = saved


# -- PyTorch Lightning --------------------------------------------------------

_lightning_classes = {}


def _first_dim(batch):
    """The leading dimension of a batch: a tensor, or the first tensor of a
    list, tuple or dict; None when there is none."""
    for _ in range(4):
        shape = getattr(batch, "shape", None)
        if shape is not None:
            try:
                return int(shape[0])
            except Exception:
                return None
        if isinstance(batch, dict):
            batch = next(iter(batch.values()), None)
        elif isinstance(batch, (list, tuple)) and batch:
            batch = batch[0]
        else:
            return None
    return None


def _lightning_batch_size(trainer, batch):
    loader = getattr(trainer, "train_dataloader", None)
    size = getattr(loader, "batch_size", None)
    if isinstance(size, int):
        return size
    return _first_dim(batch)


def _lightning_step(trainer):
    return trainer.global_step


def _lightning_step_counter(trainer):
    """The progress counter behind ``trainer.global_step`` (its
    ``completed`` is the step), so that a step reads one attribute instead
    of a chain of properties; None, and ``trainer.global_step`` is read
    instead, when this Lightning keeps it elsewhere or the two disagree.
    Lightning updates the counter in place, also when it restores a
    checkpoint; it is looked up again at each epoch's start."""
    try:
        loop = trainer.fit_loop.epoch_loop
        module = trainer.lightning_module
        if module is None or module.automatic_optimization:
            counter = loop.automatic_optimization.optim_progress.optimizer.step.total
        else:
            counter = loop.manual_optimization.optim_step_progress.total
        if counter.completed.__class__ is int and counter.completed == trainer.global_step:
            return counter
    except Exception:
        pass
    return None


def _make_lightning_class(module):
    callback_base = module.Callback
    # Lightning 2 skips a callback hook that is None: the step is then
    # marked from the module's own batch hooks (see _ModuleHooks).
    module_hooks = _skips_hooks_set_to_none(module)

    class MemtrackLightningCallback(callback_base):
        """memtrack's phases for a Lightning ``Trainer``; see
        memtrack.frameworks."""

        def __init__(self):
            super().__init__()
            self._steps = _Steps()
            self._stages = _Stages()
            self._labelled = False
            self._step_at = 0
            self._done = None  # see _lightning_step_counter
            self._trainer = None

        def on_fit_start(self, trainer, pl_module):
            self._trainer = trainer
            if module_hooks:
                _ModuleHooks.attach(pl_module, self)
            self._stages.begin("fit", trainer.global_step)
            announce_mlflow()

        def on_fit_end(self, trainer, pl_module):
            _ModuleHooks.detach(pl_module)
            self._steps.end()
            self._stages.end("fit")

        def on_exception(self, trainer, pl_module, exception):
            _ModuleHooks.detach(pl_module)
            self._steps.end()
            self._stages.end_all(exception)

        def on_train_epoch_start(self, trainer, pl_module):
            self._trainer = trainer
            self._done = _lightning_step_counter(trainer)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self._trainer = trainer
            self._step_begin(batch)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self._step_end()

        def _step_begin(self, batch):
            steps = self._steps
            if steps.open_at is None:
                trainer = self._trainer
                if not self._labelled:
                    self._label(trainer, batch)
                done = self._done
                step = self._step_at = done.completed if done is not None else trainer.global_step
                steps.begin(step + 1)

        def _step_end(self):
            # Under gradient accumulation a step spans several batches: it
            # ends when the optimizer stepped.
            done = self._done
            if (done.completed if done is not None else self._trainer.global_step) != self._step_at:
                self._steps.end()

        def _label(self, trainer, batch):
            self._labelled = True
            self._steps.labels = batch_labels(
                _lightning_batch_size(trainer, batch),
                getattr(trainer, "accumulate_grad_batches", None),
                getattr(trainer, "world_size", None),
                getattr(trainer, "global_rank", None))
            self._done = _lightning_step_counter(trainer)

        def on_train_epoch_end(self, trainer, pl_module):
            self._steps.end()

        def on_validation_start(self, trainer, pl_module):
            name = "sanity_check" if getattr(trainer, "sanity_checking", False) else "evaluate"
            self._stages.begin(name, trainer.global_step)

        def on_validation_end(self, trainer, pl_module):
            self._stages.end("sanity_check")
            self._stages.end("evaluate")

        def on_test_start(self, trainer, pl_module):
            self._stages.begin("test", trainer.global_step)

        def on_test_end(self, trainer, pl_module):
            self._stages.end("test")

        def on_predict_start(self, trainer, pl_module):
            self._stages.begin("predict", trainer.global_step)

        def on_predict_end(self, trainer, pl_module):
            self._stages.end("predict")

        def setup(self, trainer, pl_module, stage):
            _wrap_method(trainer, "save_checkpoint", "save", _lightning_step)

    # Read by Lightning at every hook it calls (a property on its base class).
    MemtrackLightningCallback.state_key = MemtrackLightningCallback.__qualname__
    if module_hooks:
        for name in _UNUSED_BATCH_HOOKS + _MODULE_BATCH_HOOKS:
            setattr(MemtrackLightningCallback, name, None)
    return MemtrackLightningCallback


class _ModuleHooks(object):
    """The step marked from the ``LightningModule``'s own
    ``on_train_batch_start`` and ``on_train_batch_end``, which Lightning
    calls at every batch whether memtrack is there or not: a callback's
    hooks are each called inside a profiler context of their own, which
    cost a step more than memtrack's own work. While a fit runs, the
    module's class has the two wrapped (the class, not the instance, so
    the module pickles and copies as before); the wrappers call the
    module's own hooks and return what they return. A module of that class
    not being fitted under memtrack goes straight to its own hooks."""

    # The modules being fitted, by id: (a weak reference to the module, its
    # callback). A dict lookup and a call of the reference, so that a batch
    # pays no Python-level lookup (a WeakKeyDictionary's get is one).
    fitting = {}
    # The classes wrapped, each with what its own __dict__ held.
    wrapped = {}

    @classmethod
    def attach(cls, pl_module, callback):
        klass = type(pl_module)
        if klass not in cls.wrapped:
            saved = {}
            for name, wrap in (("on_train_batch_start", _batch_start), ("on_train_batch_end", _batch_end)):
                saved[name] = klass.__dict__.get(name, _NOT_OWN)
                setattr(klass, name, wrap(getattr(klass, name)))
            cls.wrapped[klass] = saved
        cls.fitting[id(pl_module)] = (weakref.ref(pl_module), callback)

    @classmethod
    def detach(cls, pl_module):
        cls.fitting.pop(id(pl_module), None)
        klass = type(pl_module)
        saved = cls.wrapped.get(klass)
        if saved is None or any(type(ref()) is klass for ref, _ in list(cls.fitting.values())):
            return
        del cls.wrapped[klass]
        for name, own in saved.items():
            if own is _NOT_OWN:
                delattr(klass, name)
            else:
                setattr(klass, name, own)


_NOT_OWN = object()
_fitting = _ModuleHooks.fitting


def _batch_start(hook):
    def on_train_batch_start(self, *args, **kwargs):
        fitting = _fitting.get(id(self))
        if fitting is not None and fitting[0]() is self:
            fitting[1]._step_begin(args[0] if args else kwargs.get("batch"))
        return hook(self, *args, **kwargs)
    on_train_batch_start.__wrapped__ = hook
    return on_train_batch_start


def _batch_end(hook):
    def on_train_batch_end(self, *args, **kwargs):
        result = hook(self, *args, **kwargs)
        fitting = _fitting.get(id(self))
        if fitting is not None and fitting[0]() is self:
            fitting[1]._step_end()
        return result
    on_train_batch_end.__wrapped__ = hook
    return on_train_batch_end


# Hooks Lightning calls on every callback at every step or batch, each inside
# a profiler context, whether the callback overrides them or not: about 4 µs
# apiece. memtrack's callback uses none of them.
_MODULE_BATCH_HOOKS = ("on_train_batch_start", "on_train_batch_end")
_UNUSED_BATCH_HOOKS = (
    "on_before_backward", "on_after_backward", "on_before_optimizer_step", "on_before_zero_grad",
    "on_validation_batch_start", "on_validation_batch_end", "on_test_batch_start",
    "on_test_batch_end", "on_predict_batch_start", "on_predict_batch_end")


def _skips_hooks_set_to_none(module):
    """Whether this Lightning skips a callback hook that is not callable
    (``if callable(fn)`` in ``trainer.call._call_callback_hooks``, as in
    Lightning 2): then the unused per-step hooks can be None and cost the
    loop nothing. An older one calls them directly, so they stay."""
    try:
        import importlib
        import inspect

        call = importlib.import_module(module.__name__ + ".trainer.call")
        return "callable(fn)" in inspect.getsource(call._call_callback_hooks)
    except Exception:
        return False


def _lightning_module():
    """``lightning.pytorch`` when importable and already in use, else
    ``pytorch_lightning``."""
    import sys

    for name in ("lightning.pytorch", "pytorch_lightning"):
        if name in sys.modules:
            return sys.modules[name]
    try:
        import lightning.pytorch as module
    except ImportError:
        import pytorch_lightning as module
    return module


def lightning_callback(module=None):
    """A new Lightning ``Callback`` marking memtrack's phases (ImportError
    without Lightning). ``module`` is ``lightning.pytorch`` or
    ``pytorch_lightning`` (default: whichever the job imported)."""
    module = module or _lightning_module()
    key = module.__name__
    cls = _lightning_classes.get(key)
    if cls is None:
        cls = _lightning_classes[key] = _make_lightning_class(module)
    return cls()


def attach_lightning(trainer, module=None):
    """Add memtrack's callback to a built Lightning ``Trainer``; returns it."""
    callback = lightning_callback(module)
    trainer.callbacks.append(callback)
    _wrap_method(trainer, "save_checkpoint", "save", _lightning_step)
    return callback
